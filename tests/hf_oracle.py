"""An oracle that is not Paddle: Hugging Face's Llama (and Qwen2) arithmetic written out in float64 numpy from the
architecture's definition (RMSNorm, rotate-half rotary with rope_theta and rope scaling linear / dynamic / llama3
as transformers' modeling_rope_utils computes them, grouped-query causal
attention with optional q/k/v biases, SwiGLU, tied or untied head), and small random checkpoints written in HF format
(config.json + safetensors, sharded with an index, float32 / float16 / bfloat16) for the import tests."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def hf_logits(state: dict, config: dict, ids: np.ndarray) -> np.ndarray:
    """transformers' LlamaForCausalLM / Qwen2ForCausalLM forward over one sequence: logits [T, V]."""
    s = {k: np.asarray(v, dtype=np.float64) for k, v in state.items()}
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    hd, eps, T = config["hidden_size"] // heads, config["rms_norm_eps"], len(ids)
    angles = np.concatenate([np.outer(np.arange(T), inv_freq(config, T))] * 2, axis=-1)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]

    def rope(x):
        half = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)
        return x * cos + half * sin

    def project(x, name):
        return x @ s[name + ".weight"].T + (s[name + ".bias"] if name + ".bias" in s else 0)

    h = s["model.embed_tokens.weight"][ids]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms(h, s[p + "input_layernorm.weight"], eps)
        q = rope(project(x, p + "self_attn.q_proj").reshape(T, heads, hd))
        k = rope(project(x, p + "self_attn.k_proj").reshape(T, kv, hd)).repeat(heads // kv, axis=1)
        v = project(x, p + "self_attn.v_proj").reshape(T, kv, hd).repeat(heads // kv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + np.triu(np.full((T, T), -1e30), 1)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        h = h + np.einsum("hqk,khd->qhd", weights, v).reshape(T, -1) @ s[p + "self_attn.o_proj.weight"].T
        x = _rms(h, s[p + "post_attention_layernorm.weight"], eps)
        gate = x @ s[p + "mlp.gate_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * (x @ s[p + "mlp.up_proj.weight"].T)) @ s[p + "mlp.down_proj.weight"].T
    head = s["lm_head.weight"] if "lm_head.weight" in s else s["model.embed_tokens.weight"]
    return _rms(h, s["model.norm.weight"], eps) @ head.T


def inv_freq(config: dict, T: int) -> np.ndarray:
    """transformers' rotary frequencies for a T-token forward: default, linear (inv_freq / factor), dynamic (NTK: the
    base raised for max(T, max_position_embeddings)) and llama3 (_compute_llama3_parameters)."""
    heads = config["num_attention_heads"]
    hd, base = config["hidden_size"] // heads, config.get("rope_theta", 10000.0)
    scaling = config.get("rope_scaling") or {}
    kind, factor = scaling.get("rope_type", scaling.get("type")), scaling.get("factor", 1.0)
    if kind == "dynamic":
        length, context = max(T, config["max_position_embeddings"]), config["max_position_embeddings"]
        base = base * ((factor * length / context) - (factor - 1)) ** (hd / (hd - 2))
    inv = 1.0 / base ** (np.arange(0, hd, 2) / hd)
    if kind == "linear":
        return inv / factor
    if kind != "llama3":
        return inv
    low, high, old = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv
    out = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, (1 - smooth) * out / factor + smooth * out, out)


def llama_config(**changes) -> dict:
    """A small Llama's config.json: grouped-query attention, a Llama-3 rotary base."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "vocab_size": 160,
            "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "bos_token_id": 2, "eos_token_id": 3, "torch_dtype": "bfloat16", **changes}


def random_state(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named random weights of `config`'s shape (torch's [out, in]); no lm_head when tied; q/k/v biases for
    Qwen2."""
    rng = np.random.default_rng(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_dim = (config.get("num_key_value_heads") or heads) * (h // heads)

    def w(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    state = {"model.embed_tokens.weight": w(v, h, scale=1.0), "model.norm.weight": 1 + w(h, scale=0.1)}
    if not config.get("tie_word_embeddings"):
        state["lm_head.weight"] = w(v, h)
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        state.update({p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv_dim, h),
                      p + "self_attn.v_proj.weight": w(kv_dim, h), p + "self_attn.o_proj.weight": w(h, h),
                      p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                      p + "mlp.down_proj.weight": w(h, i), p + "input_layernorm.weight": 1 + w(h, scale=0.1),
                      p + "post_attention_layernorm.weight": 1 + w(h, scale=0.1)})
        if config["architectures"] == ["Qwen2ForCausalLM"]:
            state.update({p + "self_attn.q_proj.bias": w(h), p + "self_attn.k_proj.bias": w(kv_dim),
                          p + "self_attn.v_proj.bias": w(kv_dim)})
    return state


def as_dtype(state: dict, dtype: str) -> dict:
    """The weights as a checkpoint in `dtype` would hold them, back in float32 (what the import reads)."""
    if dtype == "float16":
        return {k: v.astype(np.float16).astype(np.float32) for k, v in state.items()}
    if dtype == "bfloat16":  # (round to nearest even on the upper 16 bits)
        bits = {k: v.astype(np.float32).view(np.uint32).astype(np.uint64) for k, v in state.items()}
        return {k: (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
                for k, b in bits.items()}
    return state


def write_checkpoint(directory: Path, config: dict, state: dict, dtype: str = "float32", shards: int = 1) -> Path:
    """`directory` in HF format: config.json and the weights in `dtype` (bfloat16 written as its raw bits, as torch
    saves it), in `shards` files named by model.safetensors.index.json when more than one."""
    import struct

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    names = sorted(state)
    groups = [names[k::shards] for k in range(shards)]
    files = ["model.safetensors"] if shards == 1 else [f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
                                                       for k in range(shards)]
    for file, group in zip(files, groups):
        header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
        for name in group:
            value = as_dtype({name: state[name]}, dtype)[name]
            raw = (value.view(np.uint32) >> 16).astype(np.uint16).tobytes() if dtype == "bfloat16" else \
                value.astype(np.float16 if dtype == "float16" else np.float32).tobytes()
            code = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[dtype]
            header[name] = {"dtype": code, "shape": list(value.shape), "data_offsets": [offset, offset + len(raw)]}
            blobs.append(raw)
            offset += len(raw)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        (directory / file).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    if shards > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {n: files[k] for k, group in enumerate(groups) for n in group}}))
    return directory
