"""Serving's runtime over an export directory's programs: paddle.inference predictors, configured as served, and
the key/value-cache session that generation drives. Export's parity gates use the same functions, so what is checked
is what is served."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import serving  # noqa: F401  (zlib before paddle)
from core.exportdir import (DECODE_PREFIX, EXTEND_PREFIX, FEED_NAME, KEY_MASK_NAME, MODEL_PREFIX, PAST_KINDS,
                            POSITIONS_NAME, PREFILL_PREFIX, has_extend_program, past_input)
from serving.engine.generation import StepLogits
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
    # Buffers reused between a program's variables. Without it a predictor keeps every intermediate of its largest
    # run: a 0.5B model's prefill of 8 x 200 tokens took 8.5 GB more and 25.4 s (page faults) instead of 0.24 GB
    # and 6.2 s; the default model's decode and prefill steps equal or 3-4% faster; outputs bit-identical.
    config.enable_memory_optim()
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


def cache_session(export_dir: Path, threads: int = 1, placement: Placement = Placement(), zero_copy: bool = True,
                  timings: dict | None = None):
    """(prefill, decode) functions over this process's own predictors of the cache programs (one session per thread
    or process: paddle.inference predictors are not thread-safe):

        prefill(ids, positions, mask) -> logits [B,V], keys [L,B,Hkv,T,D], values
        decode(ids [B,1], cache: serving/engine/kv_cache.py DecodeCache) -> logits [B,V] (format 4: a
            serving/engine/generation.py StepLogits, its argmax fetched and its logits when asked for)

    The decode program takes each layer's cache as an input of its own and returns only the new token's keys and
    values (export/programs.py); the cache's owner holds them in buffers with room to grow, and decode writes the new
    column there. On the CPU the predictor reads those buffers in place (`zero_copy`, share_external_data): copying
    the whole cache into the predictor's inputs each step was 6.5 ms of a 30 ms step at batch 256 (the default
    model, 80 cached positions), and its traffic made the column writes after it 3x slower; 21.5 ms without (bench
    section "steps"). `timings` (the bench's): seconds spent feeding, running, fetching and appending, summed over
    the decode steps into its keys. Exports made before (one stacked cache in, the grown caches out) are read too."""
    export_dir = Path(export_dir)
    prefill = create_predictor(export_dir, prefix=PREFILL_PREFIX, threads=threads, placement=placement)
    decode = create_predictor(export_dir, prefix=DECODE_PREFIX, threads=threads, placement=placement)
    names = decode.get_input_names()
    if PAST_KINDS[0] in names:  # (the earlier form: one stacked input per kind, the grown caches out)
        def stacked_step(ids, cache):
            positions, keys, values, mask = cache.step_inputs()
            logits, grown_keys, grown_values = run(decode, ids, positions, mask, keys, values)
            cache.append(grown_keys[:, :, :, -1:], grown_values[:, :, :, -1:])
            return logits

        return (lambda *feeds: run(prefill, *feeds)), stacked_step
    in_place = zero_copy and placement.device == "cpu"  # (a GPU predictor's inputs live on the GPU: copied there)
    return (lambda *feeds: run(prefill, *feeds)), _decode_function(decode, in_place, timings)


def _decode_function(decode, in_place: bool, timings: dict | None):
    """cache_session's decode(ids, cache) over the decode predictor of export format 2-4 (one input per layer
    and kind); `in_place`: the cache's buffers shared with the predictor, not copied into it."""
    names = decode.get_input_names()
    layers = sum(past_input(PAST_KINDS[0], layer) in names for layer in range(len(names)))
    layer_inputs = [[decode.get_input_handle(past_input(kind, layer)) for layer in range(layers)]
                    for kind in PAST_KINDS]
    step_inputs = [decode.get_input_handle(name) for name in (FEED_NAME, POSITIONS_NAME, KEY_MASK_NAME)]
    outputs = [decode.get_output_handle(name) for name in decode.get_output_names()]
    with_argmax = len(outputs) == 4  # (export format 4: logits, new keys, new values, argmax)

    def fetch_logits() -> np.ndarray:
        t0 = time.perf_counter()
        logits = outputs[0].copy_to_cpu()
        if timings is not None:  # (a fetch, wherever it happens)
            timings["fetch"] = timings.get("fetch", 0.0) + time.perf_counter() - t0
        return logits

    def decode_step(ids, cache):
        marks = [time.perf_counter()] if timings is not None else None
        positions, keys, values, mask = cache.step_inputs()
        for handle, value in zip(step_inputs, (ids, positions, mask)):
            _feed(handle, value)
        if in_place:
            for handles, tensors in zip(layer_inputs, _shared_buffers(cache, keys, values)):
                for handle, tensor in zip(handles, tensors):
                    handle.share_external_data(tensor)
        else:
            for handles, buffers in zip(layer_inputs, (keys, values)):
                for layer, handle in enumerate(handles):
                    _feed(handle, buffers[layer])  # (buffers[layer]: a contiguous view, copied into the predictor)
        _mark(marks)
        decode.run()
        _mark(marks)
        if with_argmax:  # (format 4: the logits stay in the predictor until a row needs them)
            new_keys, new_values, greedy = (handle.copy_to_cpu() for handle in outputs[1:])
            logits = StepLogits(greedy, fetch_logits)
        else:
            logits, new_keys, new_values = (handle.copy_to_cpu() for handle in outputs)
        _mark(marks)
        cache.append(new_keys, new_values)
        if marks:
            _mark(marks)
            for part, start, stop in zip(STEP_PARTS, marks, marks[1:]):
                timings[part] = timings.get(part, 0.0) + stop - start
        return logits

    return decode_step


STEP_PARTS = ("feed", "program", "fetch", "append")  # (cache_session's timings)


def _mark(marks: list | None) -> None:
    if marks is not None:
        marks.append(time.perf_counter())


def _shared_buffers(cache, keys: np.ndarray, values: np.ndarray) -> list:
    """Paddle tensors over each layer's key and value buffers, sharing their memory (made once a buffer: the cache
    drops them when it moves to new buffers, kv_cache.py `external`). The decode program only reads its past inputs:
    tests/unit/test_export_programs.py checks the buffers are unchanged after a step."""
    if cache.external is None:
        import paddle  # (loaded with the first session, as create_predictor loads paddle.inference)

        if not (keys.flags.c_contiguous and values.flags.c_contiguous):  # (paddle would copy: a stale view)
            raise ValueError("the decode cache's buffers must be contiguous to be read in place")
        cache.external = [[paddle.Tensor(buffers[layer], paddle.CPUPlace(), False, True)  # (zero_copy=True)
                           for layer in range(len(buffers))] for buffers in (keys, values)]
    return cache.external


def extend_session(export_dir: Path, threads: int = 1, placement: Placement = Placement()):
    """extend(ids [B,T], positions [B,T], mask [B,P+T], past keys [L,B,Hkv,P,D], past values) -> logits [B,V],
    keys [L,B,Hkv,T,D], values (the T new tokens'), over this process's own predictor of the extend program; None
    for an export made before it (format < 3: served without prefix caching)."""
    export_dir = Path(export_dir)
    if not has_extend_program(export_dir):
        return None
    predictor = create_predictor(export_dir, prefix=EXTEND_PREFIX, threads=threads, placement=placement)
    names = predictor.get_input_names()

    def extend(ids, positions, mask, keys, values):
        layers = {past_input(kind, layer): buffers[layer] for kind, buffers in zip(PAST_KINDS, (keys, values))
                  for layer in range(len(buffers))}
        feeds = {FEED_NAME: ids, POSITIONS_NAME: positions, KEY_MASK_NAME: mask, **layers}
        return run(predictor, *(feeds[name] for name in names))

    return extend


def _feed(handle, value: np.ndarray) -> None:
    handle.reshape(list(value.shape))
    handle.copy_from_cpu(np.ascontiguousarray(value))
