"""export's LoRA merge gate (export/gates.py lora_merge_gate): a checkpoint's adapters merged into the base must
compute what PaddleNLP's LoRAModel computes over the base as it trained; a wrong merge (a transposed adapter, a
wrong alpha / r scale, the LM head trained whole left out) fails it, a right one passes with a wide margin."""
import numpy as np
import pytest

import core  # noqa: F401  (zlib before paddle)
import paddle  # noqa: E402
from paddlenlp.peft import LoRAConfig, LoRAModel  # noqa: E402
from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from core.config import load_config  # noqa: E402
from export import ExportError, convert, gates  # noqa: E402
from training.finetune import lora  # noqa: E402


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    """A small random base on disk and a LoRA checkpoint of it (adapters on q/v, the LM head trained whole) whose
    adapters are far from zero, as the Trainer writes it (lora_config.json, peft_model-*.safetensors)."""
    root = tmp_path_factory.mktemp("lora")
    paddle.seed(5)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    base.save_pretrained(str(root / "base"))
    settings = LoRAConfig(target_modules=[".*q_proj.*", ".*v_proj.*"], r=4, lora_alpha=8, merge_weights=False,
                          trainable_modules=["lm_head.weight"], dtype="float32",
                          base_model_name_or_path=str(root / "base"))
    model = LoRAModel(base, settings)
    model.mark_only_lora_as_trainable()
    rng = np.random.default_rng(0)
    for name, weight in model.get_trainable_state_dict().items():
        weight.set_value(paddle.to_tensor(weight.numpy() + rng.normal(0, 0.3, weight.shape).astype("float32")))
    checkpoint = root / "checkpoint-4"
    model.save_pretrained(str(checkpoint))  # (lora_config.json and PaddleNLP's own weights file: as_trained reads it)
    save_file({k: v.numpy() for k, v in model.get_trainable_state_dict().items()},
              str(checkpoint / "peft_model-00001-of-00001.safetensors"))
    return checkpoint


def merged_gate(checkpoint):
    model = convert.load_checkpoint(checkpoint)
    return gates.lora_merge_gate(model, checkpoint, load_config(None, ["training.seq_length=16"]))


def test_a_right_merge_passes_with_margin(lora_checkpoint):
    relative = merged_gate(lora_checkpoint)
    assert relative is not None and relative < 1e-5  # (float32 rounding: the tolerance is 1e-4)
    assert gates.lora_merge_gate(convert.load_checkpoint(lora_checkpoint.parent / "base"),
                                 lora_checkpoint.parent / "base", load_config(None)) is None  # (not LoRA)


@pytest.mark.parametrize("fault", ["transposed adapter", "alpha instead of alpha / r", "LM head left out"])
def test_a_wrong_merge_fails(lora_checkpoint, monkeypatch, fault):
    read = lora.read_lora

    def faulty(checkpoint):
        settings, adapters = read(checkpoint)
        if fault == "transposed adapter":  # (q/v are square here: B.T @ A.T = (A @ B).T fits the weight)
            adapters = {k: (adapters[k[:-1] + "B"].T if k.endswith("A") else adapters[k[:-1] + "A"].T)
                        if k.endswith((".lora_A", ".lora_B")) else v for k, v in adapters.items()}
        elif fault == "LM head left out":
            adapters = {k: v for k, v in adapters.items() if k != "lm_head.weight"}
        return settings, adapters

    monkeypatch.setattr(lora, "read_lora", faulty)
    if fault == "alpha instead of alpha / r":
        monkeypatch.setattr(lora, "lora_scaling", lambda settings: settings["lora_alpha"])
    with pytest.raises(ExportError, match="a wrong merge; nothing was published"):
        merged_gate(lora_checkpoint)
