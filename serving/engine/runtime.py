"""Serving's runtime over an export directory's programs: paddle.inference predictors, configured as served, and
the key/value-cache session that generation drives. Export's parity gates use the same functions, so what is checked
is what is served."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

import serving  # noqa: F401  (zlib before paddle)
from core.exportdir import (DECODE_PREFIX, FEED_NAME, KEY_MASK_NAME, MODEL_PREFIX, PAST_KINDS, POSITIONS_NAME,
                            PREFILL_PREFIX, past_input)
from serving.protocol import DEFAULTS


@dataclass(frozen=True)
class Placement:
    """Where a predictor runs: the CPU, or one GPU with its memory pool and precision (serving/engine/placement.py)."""
    device: str = DEFAULTS.device
    device_id: int = 0
    memory_mb: int = DEFAULTS.gpu_memory_mb
    precision: str = DEFAULTS.precision

    def describe(self) -> str:
        return "cpu" if self.device == "cpu" else f"gpu:{self.device_id} {self.precision}"


def create_predictor(export_dir: Path, ir_optim: bool = False, prefix: str = MODEL_PREFIX, threads: int = 1,
                     placement: Placement = Placement()):
    """A paddle.inference predictor for one of the graphs, configured as the served model is: on CPU with `threads`
    math threads (ir_optim off), or on one GPU (`placement`)."""
    from paddle import inference

    config = inference.Config(str(export_dir / f"{prefix}.pdmodel"), str(export_dir / f"{prefix}.pdiparams"))
    if placement.device == "gpu":
        precision = {"float32": inference.PrecisionType.Float32, "float16": inference.PrecisionType.Half,
                     "bfloat16": inference.PrecisionType.Bfloat16}[placement.precision]
        config.enable_use_gpu(placement.memory_mb, placement.device_id, precision)
        # (a reduced precision is applied by Paddle Inference's mixed-precision IR pass: optimisation on)
        ir_optim = ir_optim or placement.precision != "float32"
    else:
        config.disable_gpu()
        config.set_cpu_math_library_num_threads(threads)
    config.disable_glog_info()
    # Generation feeds a new sequence length at every step; with IR optimisation on, the CPU predictor measured
    # 2x slower per generated token. Same setting as the served model (ir_optim: false).
    config.switch_ir_optim(ir_optim)
    return inference.create_predictor(config)


def run(predictor, *inputs: np.ndarray) -> list[np.ndarray]:
    """Feed the inputs in the graph's input order; all outputs in its output order."""
    for name, value in zip(predictor.get_input_names(), inputs):
        _feed(predictor.get_input_handle(name), value)
    predictor.run()
    return [predictor.get_output_handle(name).copy_to_cpu() for name in predictor.get_output_names()]


def predict(predictor, input_ids: np.ndarray) -> np.ndarray:
    """The full-sequence graph: logits [B, T, V]."""
    return run(predictor, input_ids.astype("int64"))[0]


def cache_session(export_dir: Path, threads: int = 1, placement: Placement = Placement()):
    """(prefill, decode) functions over this process's own predictors of the cache programs (one session per thread
    or process: paddle.inference predictors are not thread-safe):

        prefill(ids, positions, mask) -> logits [B,V], keys [L,B,Hkv,T,D], values
        decode(ids, positions, mask, keys [L,B,Hkv,P,D], values) -> logits [B,V], keys [L,B,Hkv,P+1,D], values

    The decode program takes each layer's cache as an input of its own and returns only the new token's keys and
    values (export/programs.py); they are written into the next free column of buffers with room to grow
    (_GrowingCache): no copy of the whole cache in Python a step, only the predictor's own. Exports made before
    (one stacked cache in, the grown caches out) are read too."""
    export_dir = Path(export_dir)
    prefill = create_predictor(export_dir, prefix=PREFILL_PREFIX, threads=threads, placement=placement)
    decode = create_predictor(export_dir, prefix=DECODE_PREFIX, threads=threads, placement=placement)
    names = decode.get_input_names()
    if PAST_KINDS[0] in names:  # (the earlier form: one stacked input per kind)
        return (lambda *feeds: run(prefill, *feeds)), (lambda *feeds: run(decode, *feeds))
    layers = sum(past_input(PAST_KINDS[0], layer) in names for layer in range(len(names)))
    layer_inputs = [[decode.get_input_handle(past_input(kind, layer)) for layer in range(layers)]
                    for kind in PAST_KINDS]
    step_inputs = [decode.get_input_handle(name) for name in (FEED_NAME, POSITIONS_NAME, KEY_MASK_NAME)]
    outputs = [decode.get_output_handle(name) for name in decode.get_output_names()]

    grown = _GrowingCache()

    def decode_step(ids, positions, mask, keys, values):
        keys, values, mask = grown.hold(keys, values, mask)
        for handle, value in zip(step_inputs, (ids, positions, mask)):
            _feed(handle, value)
        for handles, cache in zip(layer_inputs, (keys, values)):
            for layer, handle in enumerate(handles):
                _feed(handle, cache[layer])  # (cache[layer]: a contiguous view, copied once into the predictor)
        decode.run()
        logits, new_keys, new_values = (handle.copy_to_cpu() for handle in outputs)
        return (logits, *grown.append(new_keys, new_values))

    return (lambda *feeds: run(prefill, *feeds)), decode_step


class _GrowingCache:
    """The decode steps' caches in buffers with room to grow, so that a step writes only its new column instead of
    copying the whole cache into a wider array (np.concatenate: ~20% of a step at 128 sequences, measured).

    `hold` takes the caches the scheduler passes back: the views this object returned last (then nothing is copied)
    or new arrays (after sequences joined or left: copied once into buffers with GROW free columns). The predictor is
    fed the whole buffer; the free columns are masked (model/llama.py MASKED: weight exactly 0 after the softmax).
    `append` writes the step's new keys and values into the next free column and returns views of the used part."""
    GROW = 32

    def __init__(self):
        self.keys = self.values = None
        self.used = 0

    def _ours(self, keys: np.ndarray, values: np.ndarray) -> bool:
        return self.keys is not None and keys.base is self.keys and values.base is self.values \
            and keys.shape[3] == self.used and keys.ctypes.data == self.keys.ctypes.data \
            and values.ctypes.data == self.values.ctypes.data and keys.shape[:3] == self.keys.shape[:3]

    def hold(self, keys: np.ndarray, values: np.ndarray, mask: np.ndarray):
        """(keys, values, mask) as fed: the buffers, and the mask widened to them (free columns 0)."""
        width = keys.shape[3]
        if not self._ours(keys, values) or width == self.keys.shape[3]:
            shape = list(keys.shape)
            shape[3] = width + self.GROW
            self.keys, self.values = np.zeros(shape, dtype=keys.dtype), np.zeros(shape, dtype=values.dtype)
            self.keys[:, :, :, :width], self.values[:, :, :, :width] = keys, values
            self.used = width
        capacity = self.keys.shape[3]
        wide = np.zeros((mask.shape[0], capacity + 1), dtype=mask.dtype)
        wide[:, :width], wide[:, capacity] = mask[:, :width], mask[:, width]
        return self.keys, self.values, wide

    def append(self, new_keys: np.ndarray, new_values: np.ndarray):
        self.keys[:, :, :, self.used], self.values[:, :, :, self.used] = new_keys[:, :, :, 0], new_values[:, :, :, 0]
        self.used += 1
        return self.keys[:, :, :, :self.used], self.values[:, :, :, :self.used]


def _feed(handle, value: np.ndarray) -> None:
    handle.reshape(list(value.shape))
    handle.copy_from_cpu(np.ascontiguousarray(value))
