"""The Hugging Face checkpoint format, both ways: a directory people bring (`config.json`, `model.safetensors` or
shards named by `model.safetensors.index.json`) read as this project's model, and the mapping export/hf.py writes
with. No paddle and no torch: json, numpy and `safetensors`.

Reading (`model.init_from=<HF directory>`):
    read_config     config.json checked (architecture, rope scaling, shapes), each refusal one line
    model_settings  the model.* settings the checkpoint fixes (core/config.py applies them: its shape wins)
    converted       the PaddleNLP directory PaddleNLP's `from_pretrained` loads (config.json + the weights in
                    PaddleNLP's names and [in, out] layout; tensor-parallel ranks load their slices from it), made
                    once per content key under the user cache and reused, like prepared data
The mapping (checked against HF's Llama arithmetic, written out in numpy: tests/hf_oracle.py): HF's `model.*` is
PaddleNLP's `llama.*`; every Linear weight is transposed (torch stores [out, in], Paddle [in, out]), the LM head too;
HF's rotary is rotate-half, as PaddleNLP's, so q/k need no permutation. A tied checkpoint (no `lm_head.weight`,
`tie_word_embeddings`) gets the embedding's transpose as its head: this project's model keeps the two apart, and
export/hf.py ties them again when they are still equal. Rotary buffers (`rotary_emb.inv_freq`) are not weights and
are skipped; any other tensor that does not map is named in the error.

Supported: Llama-architecture models (`LlamaForCausalLM`: Llama 2 and 3, TinyLlama, Chinese-LLaMA, Yi;
`MistralForCausalLM` without a sliding window) and Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`: Llama with q/k/v biases,
model/llama.py apply_architecture), grouped-query attention, `rope_theta`, rope scaling `linear`, `dynamic` and
`llama3` (any other kind refused in one line naming it), tied or untied embeddings, float32 / float16 / bfloat16
weights (read as float32).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np

from core.errors import ConfigError

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
NOT_YET: dict[str, str] = {}
BIASED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # (Qwen2's q/k/v biases)
# HF's rope_scaling kinds this project runs -> PaddleNLP LlamaConfig's rope_scaling_type ("llama3": model/llama.py
# apply_architecture adds it). `dynamic` (NTK) changes the angles only past max_position_embeddings, which no stage
# here reaches (training.seq_length and the served context are held to it): inside it, the plain rotary.
ROPE_SCALING = {"linear": "linear", "dynamic": "dynamic_ntk", "llama3": "llama3"}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
CONVERTED_FORMAT = 2  # (part of the content key: a change to the conversion makes new directories)
SKIPPED = ("rotary_emb.inv_freq",)


def is_hf_checkpoint(path: str | Path) -> bool:
    """A directory in Hugging Face format (config.json naming `architectures`; weights named as transformers names
    them, `model.*`), not PaddleNLP's own `save_pretrained` layout (model_state.pdparams, or safetensors of `llama.*`
    tensors: this project's checkpoints) nor one converted here."""
    path = Path(path).expanduser()
    config = path / "config.json"
    if not config.is_file() or (path / "model_state.pdparams").exists() or (path / ".converted-from").exists():
        return False
    try:
        if "architectures" not in json.loads(config.read_text(encoding="utf-8")):
            return False
        files = weight_files(path)
    except (ValueError, ConfigError):
        return True  # (an HF config without readable weights: read_config names what is wrong)
    names = _header(files[0])
    return not any(name.startswith("llama.") for name in names)


def _raw_header(file: Path) -> bytes:
    """A safetensors file's first bytes: the 8-byte length, then the JSON header; the tensors' data follow."""
    with open(file, "rb") as f:
        prefix = f.read(8)
        return prefix + f.read(struct.unpack("<Q", prefix)[0])


def _header(file: Path) -> dict:
    """A safetensors file's header: {tensor name: {dtype, shape, data_offsets}} (and __metadata__)."""
    return json.loads(_raw_header(file)[8:])


def read_config(path: str | Path) -> dict:
    """config.json, checked: every refusal names the directory and the one thing to change."""
    path = Path(path).expanduser()
    try:
        hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.init_from={path}: config.json is not readable JSON ({exc.__class__.__name__})") \
            from None
    architectures = hf.get("architectures") or []
    known = [a for a in architectures if a in SUPPORTED]
    if not known:
        why = next((f"{a}: {NOT_YET[a]}" for a in architectures if a in NOT_YET), None)
        raise ConfigError(f"model.init_from={path}: architecture {architectures} is not supported"
                          + (f" ({why})" if why else "") + f"; supported: {', '.join(SUPPORTED)}")
    if hf.get("sliding_window") and hf.get("use_sliding_window", True):
        raise ConfigError(f"model.init_from={path}: sliding-window attention (sliding_window={hf['sliding_window']}) "
                          "is not supported; a Mistral-style model without it is")
    rope_scaling(hf.get("rope_scaling"), f"model.init_from={path}: rope_scaling")
    if hf.get("attention_bias") or hf.get("mlp_bias"):  # (Llama's attention_bias is o_proj's too: not Qwen2's)
        raise ConfigError(f"model.init_from={path}: attention_bias / mlp_bias (a bias on every projection) are not "
                          "supported; q/k/v biases alone (Qwen2) are")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"model.init_from={path}: hidden_act {hf['hidden_act']!r} is not supported (silu is)")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(hf.get(key), int) or hf[key] <= 0:
            raise ConfigError(f"model.init_from={path}: config.json has no positive {key}")
    weight_files(path)  # (no weights, or an index naming a missing shard: refused here, before any launch)
    return hf


def model_settings(hf: dict) -> dict:
    """The model.* settings an HF config fixes."""
    scaling = hf.get("rope_scaling") or {}
    return {"hidden_size": hf["hidden_size"], "intermediate_size": hf["intermediate_size"],
            "num_layers": hf["num_hidden_layers"], "num_attention_heads": hf["num_attention_heads"],
            "num_key_value_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
            "max_position_embeddings": hf.get("max_position_embeddings", 2048),
            "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "rope_theta": float(hf.get("rope_theta", 10000.0)),
            "rope_scaling": rope_scaling(scaling),
            "vocab_size": hf["vocab_size"], "attention_bias": qkv_bias(hf)}


def rope_scaling(scaling, where: str = "model.rope_scaling") -> dict:
    """An HF rope_scaling object checked and made plain: {} (none), {rope_type: linear|dynamic, factor} or {rope_type:
    llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}; anything else one line."""
    if not scaling:
        return {}
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}: a mapping like {{rope_type: linear, factor: 2.0}} or empty, got {scaling!r}")
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "default":
        return {}
    if kind not in ROPE_SCALING:
        raise ConfigError(f"{where} type {kind!r} is not supported; supported: {', '.join(ROPE_SCALING)} (or none)")
    keys = LLAMA3_KEYS if kind == "llama3" else ("factor",)
    missing = [k for k in keys if not isinstance(scaling.get(k), (int, float)) or scaling[k] <= 0]
    if missing:
        raise ConfigError(f"{where} {kind}: needs positive {', '.join(missing)}")
    plain = {"rope_type": kind, **{k: float(scaling[k]) for k in keys}}
    if kind == "llama3":
        plain["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
        if plain["high_freq_factor"] <= plain["low_freq_factor"]:
            raise ConfigError(f"{where} llama3: high_freq_factor must be above low_freq_factor")
    if plain["factor"] < 1.0:
        raise ConfigError(f"{where} {kind}: factor 1 or more, got {plain['factor']}")
    return plain


def paddle_rope(scaling: dict) -> dict:
    """PaddleNLP LlamaConfig's rope settings for a plain rope_scaling object (the object itself rides along: llama3's
    frequencies, and the HF copy export/hf.py writes)."""
    if not scaling:
        return {"rope_scaling_type": None, "rope_scaling_factor": 1.0, "rope_scaling": {}}
    return {"rope_scaling_type": ROPE_SCALING[scaling["rope_type"]], "rope_scaling_factor": scaling["factor"],
            "rope_scaling": scaling}


def rope_scaling_of(saved: dict) -> dict:
    """The rope_scaling object of a config.json, HF's (rope_scaling) or PaddleNLP's (rope_scaling_type/factor)."""
    if saved.get("rope_scaling"):
        return rope_scaling(saved["rope_scaling"])
    kind = {v: k for k, v in ROPE_SCALING.items()}.get(saved.get("rope_scaling_type"))
    return rope_scaling({"rope_type": kind, "factor": saved.get("rope_scaling_factor", 1.0)}) if kind else {}


def qkv_bias(hf: dict) -> bool:
    """Whether the architecture has q/k/v biases (Qwen2 and Qwen2.5)."""
    return "Qwen2ForCausalLM" in (hf.get("architectures") or [])


def weight_files(path: Path) -> list[Path]:
    """The safetensors files: the shards the index names (each must be there), else model.safetensors, else every
    *.safetensors of the directory."""
    if (path / INDEX).is_file():
        try:
            shards = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError):
            raise ConfigError(f"model.init_from={path}: {INDEX} has no weight_map") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ConfigError(f"model.init_from={path}: {INDEX} names shard(s) that are not there: "
                              f"{', '.join(missing)}")
        return [path / s for s in shards]
    files = [path / SINGLE] if (path / SINGLE).is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        extra = " (PyTorch .bin weights: convert them to safetensors first)" if list(path.glob("*.bin")) else ""
        raise ConfigError(f"model.init_from={path}: no weights (model.safetensors, or shards with {INDEX}){extra}")
    return files


# ------------------------------------------------------------------------------------------------- tensors
_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


def read_tensors(file: Path) -> dict[str, np.ndarray]:
    """One safetensors file as float32 arrays. Read from its header by hand, not with safetensors.numpy: numpy has
    no bfloat16, the dtype most checkpoints ship in (its 16 bits are float32's upper half)."""
    raw_header = _raw_header(file)
    header = json.loads(raw_header[8:])
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=len(raw_header))
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _DTYPES:
            raise ConfigError(f"{file}: tensor {name} has dtype {entry['dtype']}, not a float type")
        begin, end = entry["data_offsets"]
        raw = np.frombuffer(data[begin:end], dtype=_DTYPES[entry["dtype"]]).reshape(entry["shape"])
        out[name] = ((raw.astype(np.uint32) << 16).view(np.float32) if entry["dtype"] == "BF16"
                     else raw.astype(np.float32))
    return out


def _linear(name: str, value: np.ndarray) -> bool:
    return value.ndim == 2 and "embed_tokens" not in name


def to_paddle(hf_state: dict, hf: dict, where: str = "") -> dict[str, np.ndarray]:
    """HF names and layouts -> PaddleNLP LlamaForCausalLM's; every tensor that does not map, and every weight the
    model needs that is missing, named in one error."""
    out, unmapped = {}, []
    for name, value in hf_state.items():
        if name.endswith(SKIPPED):
            continue
        if name == "lm_head.weight":
            out[name] = np.ascontiguousarray(value.T)
        elif name.startswith("model.") and name.endswith(tuple(f"{b}.bias" for b in BIASED)) and qkv_bias(hf):
            out["llama." + name[len("model."):]] = value
        elif name.startswith("model.") and name.endswith(".weight"):
            out["llama." + name[len("model."):]] = np.ascontiguousarray(value.T) if _linear(name, value) else value
        else:
            unmapped.append(name)
    if "lm_head.weight" not in out and "llama.embed_tokens.weight" in out:  # (tied: the head is the embedding)
        out["lm_head.weight"] = np.ascontiguousarray(out["llama.embed_tokens.weight"].T)
    missing = [n for n in expected_names(hf) if n not in out]
    if unmapped or missing:
        raise ConfigError(f"model.init_from={where}: " + "; ".join(
            part for part in (f"tensors that do not map to a Llama: {', '.join(sorted(unmapped)[:8])}"
                              + (f" and {len(unmapped) - 8} more" if len(unmapped) > 8 else "") if unmapped else "",
                              f"weights missing: {', '.join(missing[:8])}" if missing else "") if part))
    return out


def expected_names(hf: dict) -> list[str]:
    """PaddleNLP's names of every weight of the model an HF config describes."""
    layer = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")
    biases = [f"llama.layers.{i}.{part}.bias" for i in range(hf["num_hidden_layers"]) for part in BIASED] \
        if qkv_bias(hf) else []
    return (["llama.embed_tokens.weight", "llama.norm.weight", "lm_head.weight"] +
            [f"llama.layers.{i}.{part}.weight" for i in range(hf["num_hidden_layers"]) for part in layer] + biases)


def to_hf(paddle_state: dict, tie: bool = False) -> dict[str, np.ndarray]:
    """PaddleNLP LlamaForCausalLM's names and layouts -> HF's (export/hf.py); `tie`: no lm_head.weight (a tied
    checkpoint's head is its embedding)."""
    out = {}
    for name, value in paddle_state.items():
        value = np.asarray(value, dtype=np.float32)
        if name == "lm_head.weight" and tie:
            continue
        if name == "lm_head.weight" or (name.endswith(".weight") and _linear(name, value)):
            value = np.ascontiguousarray(value.T)
        out["model." + name[len("llama."):] if name.startswith("llama.") else name] = value
    return out


# ------------------------------------------------------------------------------------------------- conversion
def content_key(path: Path) -> str:
    """config.json's bytes and each weight file's name, size and header (its tensors' names, dtypes, shapes and
    offsets): a changed checkpoint gets a new key without hashing gigabytes of weights."""
    digest = hashlib.sha256(f"format {CONVERTED_FORMAT}\n".encode())
    digest.update((path / "config.json").read_bytes())
    for file in weight_files(path):
        digest.update(f"{file.name} {file.stat().st_size} {file.stat().st_mtime_ns}\n".encode() + _raw_header(file))
    return digest.hexdigest()[:16]


def paddle_config(hf: dict) -> dict:
    """The config.json PaddleNLP's LlamaConfig reads for the converted directory."""
    s = model_settings(hf)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": s["vocab_size"],
            "hidden_size": s["hidden_size"], "intermediate_size": s["intermediate_size"],
            "num_hidden_layers": s["num_layers"], "num_attention_heads": s["num_attention_heads"],
            "num_key_value_heads": s["num_key_value_heads"], "max_position_embeddings": s["max_position_embeddings"],
            "rms_norm_eps": s["rms_norm_eps"], "rope_theta": s["rope_theta"],
            **paddle_rope(s["rope_scaling"]), "tie_word_embeddings": False,
            "attention_bias": s["attention_bias"],
            "bos_token_id": hf.get("bos_token_id"), "eos_token_id": _first(hf.get("eos_token_id")),
            "pad_token_id": hf.get("pad_token_id"), "dtype": "float32"}


def _first(value):
    return value[0] if isinstance(value, list) and value else value


def converted(path: str | Path, cache: Path, save_weights) -> Path:
    """The PaddleNLP directory of an HF checkpoint under `cache`/<content key>/, converted now if it is not there
    yet; `save_weights(state, directory)` writes the PaddleNLP-named arrays (model/llama.py: as model_state.pdparams).
    Written into a temporary directory and renamed into place: ranks converting at once each finish, the first
    rename wins, and a killed conversion leaves no directory behind that looks whole."""
    path = Path(path).expanduser().resolve()
    hf = read_config(path)
    target = cache / content_key(path)
    if (target / ".converted-from").is_file():
        return target
    state = {}
    for file in weight_files(path):
        state.update(read_tensors(file))
    paddle_state = to_paddle(state, hf, str(path))
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=".converting-"))
    try:
        save_weights(paddle_state, staging)
        (staging / "config.json").write_text(json.dumps(paddle_config(hf), indent=1))
        tied = "lm_head.weight" not in state
        (staging / ".converted-from").write_text(json.dumps({"source": str(path), "tied": tied}))
        try:
            os.rename(staging, target)
        except OSError:  # (another rank's conversion landed first: the same bytes)
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
