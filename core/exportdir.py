"""The export directory's names and format: the one contract between export (export/, which writes it) and serving
(which reads it: serving/engine/runtime.py runs its programs, serving/engine/exported.py its tokenizer and lineage).

    exports/<model>/<version>/
        model.pdmodel, model.pdiparams   static graph: feed `input_ids` int64 [batch, seq] -> logits float32
                                         [batch, seq, vocab] (paddle.jit.save; run with paddle.inference)
        prefill.pdmodel/.pdiparams,      the key/value-cache programs (export/programs.py has their inputs and
        decode.pdmodel/.pdiparams,       outputs); absent in exports made before them (served by the full graph);
        extend.pdmodel/.pdiparams        extend from format 3 on (before it: served without prefix caching)
        tokenizer/                       core/tokenizer.py format
        serving_server_conf.prototxt     feed/fetch description for Paddle Serving's local_predictor
        export.json                      lineage and parity metadata (REQUIRED_META at least), and format_version
        reference.json                   greedy continuations of REFERENCE_PROMPTS by the dynamic model the graph
                                         was converted from, for the smoke checks of a running server
        hf/                              with export.hf=true: the same weights in Hugging Face Llama format
                                         (export/hf.py)

plus MLflow's `python_function` metadata (MLmodel, code/, python_model.pkl, requirements: export/mlflow_model.py).
The same files are the registered model version's artifacts.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path


from core.errors import ConfigError

MODEL_PREFIX = "model"  # the full-sequence graph
PREFILL_PREFIX = "prefill"  # key/value-cache generation: prompt -> last logits + caches (export/programs.py)
DECODE_PREFIX = "decode"  # one token per sequence + each layer's cache -> logits + the token's keys/values
EXTEND_PREFIX = "extend"  # new tokens over a cached prefix -> last logits + the new tokens' keys/values
FEED_NAME = "input_ids"
# The cache programs' other inputs (export/programs.py writes them, cache_session feeds them by name).
POSITIONS_NAME, KEY_MASK_NAME = "position_ids", "key_mask"
PAST_KINDS = ("past_keys", "past_values")  # decode: one input per layer and kind, named past_input(kind, layer)
META_FILE = "export.json"
# The export format, in export.json's format_version (absent: 1). 2: the decode program runs over fused weights
# (model/decode.py, about half the ops); its inputs and outputs are those of 1, so an export of format 1 still
# serves (at its slower step). 3: the extend program (prefix caching); formats 1-2 serve without prefix caching.
# 4: the decode program also returns each row's argmax (a greedy batch fetches ids, not logits); 1-3 still serve.
# A directory of a newer format than this checkout reads is refused (read_meta).
FORMAT_VERSION = 4
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


def fine_tuned(meta: dict) -> bool:
    """Whether an export (its export.json) is a fine-tuned model: the one answer, as Config.fine_tuning for a run."""
    return bool(meta.get("finetune_data"))


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
    if format_version(meta) > FORMAT_VERSION:
        raise ConfigError(f"{export_dir} is export format {format_version(meta)}; this checkout reads formats 1-"
                          f"{FORMAT_VERSION}: update it, or re-export the run with this checkout's `make export`")
    return meta


def format_version(meta: dict) -> int:
    return int(meta.get("format_version", 1))


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


def past_input(kind: str, layer: int) -> str:
    return f"{kind}_{layer}"


def has_cache_programs(export_dir: Path, prefixes: tuple[str, ...] = (PREFILL_PREFIX, DECODE_PREFIX)) -> bool:
    return all((export_dir / f"{prefix}.{ext}").is_file() for prefix in prefixes for ext in ("pdmodel", "pdiparams"))


def has_extend_program(export_dir: Path) -> bool:
    """Whether the export can serve with prefix caching (format 3 on)."""
    return has_cache_programs(export_dir, (EXTEND_PREFIX,))
