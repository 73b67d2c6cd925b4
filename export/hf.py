"""The exported model in Hugging Face Llama format (export.hf=true): `hf/` beside the Paddle graph, with
`config.json`, `model.safetensors`, `tokenizer.json` and `tokenizer_config.json`, so the weights can go to vLLM, TGI
or llama.cpp's converters.

The mapping is core/hf_checkpoint.py's, the one `model.init_from=<HF directory>` reads with (checked against
transformers' LlamaForCausalLM: logits within 6.2e-6 and 64 identical greedy tokens, docs/platform-notes.md "vLLM on
CPU"): PaddleNLP's `llama.*` names are HF's `model.*`; every Linear weight is transposed (Paddle stores [in, out],
torch [out, in]), the LM head too; a head still equal to the embedding's transpose is written tied (an imported tied
checkpoint comes back as it came). The
tokenizer is core/tokenizer.py's fast tokenizer (the same ids as ErnieTokenizer) with a decoder that joins tokens
without spaces, as this project decodes; a chat template, when the model has one, goes into tokenizer_config.json as
the jinja over `messages` that renders core/chat.py's template.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import decoders

from core.hf_checkpoint import rope_scaling_of
from core import chat, exportdir, tracking
from core.errors import ConfigError
from core.hf_checkpoint import to_hf
from core.tokenizer import HFTokenizer, SPECIAL_TOKENS, fast_tokenizer, is_hf_tokenizer
from export.convert import load_checkpoint

HF_DIR = "hf"


def hf_state(state: dict) -> tuple[dict[str, np.ndarray], bool]:
    """PaddleNLP LlamaForCausalLM state (name -> numpy) -> (HF LlamaForCausalLM state, tied): a head that is still
    exactly the embedding's transpose (an imported tied checkpoint, untouched) is written tied, as it came."""
    head, embedding = state.get("lm_head.weight"), state.get("llama.embed_tokens.weight")
    tied = head is not None and embedding is not None and head.shape == embedding.T.shape and \
        np.array_equal(np.asarray(head), np.asarray(embedding).T)
    return to_hf(state, tie=tied), tied


def hf_config(model_config, tied: bool = False) -> dict:
    c = model_config
    plain = rope_scaling_of(c.to_dict())
    scaling = {"rope_scaling": {**plain, "type": plain["rope_type"]}} if plain else {}  # ("type": older readers')
    qwen2 = bool(getattr(c, "attention_bias", False))  # (q/k/v biases: Qwen2's architecture)
    return {**scaling, "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen2 else "llama", "hidden_act": "silu",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads or c.num_attention_heads,
            "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": float(getattr(c, "rope_theta", 10000.0)), "vocab_size": c.vocab_size,
            "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id,
            "tie_word_embeddings": tied, "attention_bias": False, "torch_dtype": "float32"}


def hf_tokenizer(tokenizer_dir: Path):
    """The fast tokenizer as HF saves it: the same ids, decoded by joining tokens ('##' pieces glued on)."""
    tok = fast_tokenizer(tokenizer_dir)
    tok.decoder = decoders.Sequence([decoders.Replace("##", ""), decoders.Fuse()])
    return tok


def hf_chat_template(template: dict) -> str:
    """core/chat.py's template as the jinja over `messages` that HF's apply_chat_template runs."""
    user, answer = template["conversation"]
    system = (template.get("system") or "").replace("system", "system_text")
    return ("{% set system_text = messages | selectattr('role', 'equalto', 'system') | map(attribute='content') "
            "| join('\\n') %}" + system +
            "{% for m in messages if m['role'] != 'system' %}{% if m['role'] == 'user' %}"
            + user.replace("{{ user }}", "{{ m['content'] }}") + "{% else %}"
            + answer.replace("{{ bot }}", "{{ m['content'] }}") + "{% endif %}{% endfor %}")


def write(model, tokenizer_dir: Path, target: Path) -> Path:
    """`target`/hf/ for the dynamic model `model` (the one the graph was converted from)."""
    out = Path(target) / HF_DIR
    out.mkdir(parents=True, exist_ok=True)
    state, tied = hf_state({k: v.numpy() for k, v in model.state_dict().items()})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model.config, tied), indent=1))
    if is_hf_tokenizer(tokenizer_dir):  # (a model's own tokenizer: its files as they came)
        HFTokenizer(tokenizer_dir).save_pretrained(out)
        return out
    hf_tokenizer(tokenizer_dir).save(str(out / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.config.max_position_embeddings,
                "bos_token": "[CLS]", "eos_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
                "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in ("[CLS]", "[SEP]", "[PAD]",
                                                                                      "[UNK]")]}
    template = chat.read(tokenizer_dir)
    if template is not None:
        settings["chat_template"] = hf_chat_template(template)
    (out / "tokenizer_config.json").write_text(json.dumps(settings, ensure_ascii=False, indent=1))
    return out


def of_export(export_dir: Path, target: Path) -> Path:
    """The HF directory of an export: its own `hf/` (export.hf=true), else converted into `target`/hf/ from the
    checkpoint it was exported from: on this disk, or downloaded from its run (export.json's checkpoint_uri)."""
    export_dir = Path(export_dir)
    if (export_dir / HF_DIR / "model.safetensors").is_file():
        return export_dir / HF_DIR
    meta = exportdir.read_meta(export_dir)
    checkpoint = Path(meta["checkpoint"])
    if not checkpoint.is_dir():
        import mlflow

        try:
            checkpoint = Path(mlflow.artifacts.download_artifacts(
                artifact_uri=meta["checkpoint_uri"], dst_path=str(Path(target) / "checkpoint"),
                tracking_uri=tracking.tracking_uri()))
        except Exception as exc:  # noqa: BLE001  (no such run / artifact, store errors)
            raise ConfigError(f"{export_dir} has no {HF_DIR}/, and its checkpoint is neither on this disk ("
                              f"{checkpoint}) nor downloadable ({meta.get('checkpoint_uri')}: "
                              f"{exc.__class__.__name__}): export it again with export.hf=true") from None
    return write(load_checkpoint(checkpoint), exportdir.tokenizer_dir(export_dir), target)
