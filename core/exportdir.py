"""The export directory: the one contract between export (which writes it) and serving and smoke (which read it).

    exports/<model>/<version>/
        model.pdmodel, model.pdiparams   static graph: feed `input_ids` int64 [batch, seq] -> logits float32
                                         [batch, seq, vocab] (paddle.jit.save; run with paddle.inference)
        tokenizer/                       core/tokenizer.py format
        serving_server_conf.prototxt     feed/fetch description for Paddle Serving's local_predictor
        export.json                      lineage and parity metadata (REQUIRED_META at least)
        reference.json                   greedy continuations of REFERENCE_PROMPTS by the dynamic model the graph
                                         was converted from, for the smoke checks of a running server

The same files are the registered model version's artifacts. Reading and writing them happens only here.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.errors import ConfigError

MODEL_PREFIX = "model"  # the full-sequence graph
PREFILL_PREFIX = "prefill"  # key/value-cache generation: prompt -> last logits + caches (training/kv_cache.py)
DECODE_PREFIX = "decode"  # one token per sequence + each layer's cache -> logits + the token's keys/values
FEED_NAME = "input_ids"
# The cache programs' other inputs (training/kv_cache.py writes them, cache_session feeds them by name).
POSITIONS_NAME, KEY_MASK_NAME = "position_ids", "key_mask"
PAST_KINDS = ("past_keys", "past_values")  # decode: one input per layer and kind, named past_input(kind, layer)
META_FILE = "export.json"
REFERENCE_FILE = "reference.json"
TOKENIZER_DIR = "tokenizer"
SERVING_CONF = "serving_server_conf.prototxt"
# What serving reads from export.json (export writes more: timings, parity shapes, config hash, ...).
REQUIRED_META = ("registered_model_name", "version", "source_run_id", "checkpoint_step", "eos_token_id",
                 "max_position_embeddings", "vocab_size", "weights_sha256")
# Greedy references recorded at export and checked by smoke against the running server.
REFERENCE_PROMPTS = ("人工智能", "这本书", "快递很快，")
REFERENCE_NEW_TOKENS = 8
# Paddle Serving's GeneralModelConfig type codes (paddle_serving_app/local_predict.py).
SERVING_TYPE_CODES = {"int64": 0, "float32": 1, "int32": 2}


def graph_files(export_dir: Path) -> tuple[Path, Path]:
    return export_dir / f"{MODEL_PREFIX}.pdmodel", export_dir / f"{MODEL_PREFIX}.pdiparams"


def tokenizer_dir(export_dir: Path) -> Path:
    return export_dir / TOKENIZER_DIR


def weights_sha256(export_dir: Path) -> str:
    return hashlib.sha256(graph_files(export_dir)[1].read_bytes()).hexdigest()


def write_meta(export_dir: Path, meta: dict) -> None:
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise ValueError(f"export.json is missing {missing}")
    (export_dir / META_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False), encoding="utf-8")


def read_meta(export_dir: Path) -> dict:
    """export.json of an export directory; a clear error when the directory is not one."""
    path = Path(export_dir) / META_FILE
    if not path.is_file():
        raise ConfigError(f"{export_dir} is not an export directory (no {META_FILE}); run `make export`")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.__class__.__name__}); export again") from None
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise ConfigError(f"{path} lacks {', '.join(missing)}; it was written by an older export: export again")
    return meta


def is_complete(export_dir: Path) -> bool:
    """All files present and the weights are those export.json names (a half-copied directory is not)."""
    try:
        meta = read_meta(export_dir)
    except ConfigError:
        return False
    model, params = graph_files(export_dir)
    return (model.is_file() and params.is_file() and (export_dir / SERVING_CONF).is_file()
            and tokenizer_dir(export_dir).is_dir() and weights_sha256(export_dir) == meta["weights_sha256"])


def write_references(export_dir: Path, references: dict[str, list[int]]) -> None:
    (export_dir / REFERENCE_FILE).write_text(json.dumps(
        {"max_new_tokens": REFERENCE_NEW_TOKENS, "greedy": references}, ensure_ascii=False, indent=2),
        encoding="utf-8")


def read_references(export_dir: Path) -> dict[str, list[int]]:
    """prompt -> greedy new token ids of the dynamic model; {} for an export made before references existed."""
    path = export_dir / REFERENCE_FILE
    return json.loads(path.read_text(encoding="utf-8"))["greedy"] if path.is_file() else {}


def write_serving_conf(export_dir: Path, feed: str, fetch: str, vocab: int) -> None:
    """serving_server_conf.prototxt (GeneralModelConfig, text format) -- written here because
    paddle_serving_client.io imports paddle.fluid, which Paddle 2.6 removed."""
    lines = ["feed_var {", f'  name: "{feed}"', f'  alias_name: "{feed}"', "  is_lod_tensor: false",
             f"  feed_type: {SERVING_TYPE_CODES['int64']}", "  shape: -1", "}",
             "fetch_var {", f'  name: "{fetch}"', f'  alias_name: "{fetch}"', "  is_lod_tensor: false",
             f"  fetch_type: {SERVING_TYPE_CODES['float32']}", "  shape: -1", f"  shape: {vocab}", "}"]
    (export_dir / SERVING_CONF).write_text("\n".join(lines) + "\n")


def fetch_name(export_dir: Path) -> str:
    """The graph's output variable, as the prototxt names it (Paddle Serving fetches by this name)."""
    text = (export_dir / SERVING_CONF).read_text()
    return text.split("fetch_var {")[1].split('name: "')[1].split('"')[0]


@dataclass(frozen=True)
class Placement:
    """Where a predictor runs: the CPU, or one GPU with its memory pool and precision (serving/placement.py)."""
    device: str = "cpu"
    device_id: int = 0
    memory_mb: int = 1024
    precision: str = "float32"

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


def past_input(kind: str, layer: int) -> str:
    return f"{kind}_{layer}"


def cache_session(export_dir: Path, threads: int = 1, placement: Placement = Placement()):
    """(prefill, decode) functions over this process's own predictors of the cache programs (one session per thread
    or process: paddle.inference predictors are not thread-safe):

        prefill(ids, positions, mask) -> logits [B,V], keys [L,B,Hkv,T,D], values
        decode(ids, positions, mask, keys [L,B,Hkv,P,D], values) -> logits [B,V], keys [L,B,Hkv,P+1,D], values

    The decode program takes each layer's cache as an input of its own and returns only the new token's keys and
    values (training/kv_cache.py); they are appended here, the one copy of the cache a step. Exports made before
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

    def decode_step(ids, positions, mask, keys, values):
        for handle, value in zip(step_inputs, (ids, positions, mask)):
            _feed(handle, value)
        for handles, cache in zip(layer_inputs, (keys, values)):
            for layer, handle in enumerate(handles):
                _feed(handle, cache[layer])  # (cache[layer]: a contiguous view, copied once into the predictor)
        decode.run()
        logits, new_keys, new_values = (handle.copy_to_cpu() for handle in outputs)
        return logits, np.concatenate([keys, new_keys], axis=3), np.concatenate([values, new_values], axis=3)

    return (lambda *feeds: run(prefill, *feeds)), decode_step


def _feed(handle, value: np.ndarray) -> None:
    handle.reshape(list(value.shape))
    handle.copy_from_cpu(np.ascontiguousarray(value))


def has_cache_programs(export_dir: Path) -> bool:
    return all((export_dir / f"{prefix}.{ext}").is_file() for prefix in (PREFILL_PREFIX, DECODE_PREFIX)
               for ext in ("pdmodel", "pdiparams"))
