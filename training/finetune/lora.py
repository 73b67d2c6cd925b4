"""LoRA fine-tuning (finetune.method=lora), wrapping and merge together: `wrap` puts PaddleNLP's `LoRAModel` around
a rank's model, only the adapters (and finetune.lora_trainable) trainable. PaddleNLP's Trainer saves a LoRA model's
checkpoint as the adapters alone (unified checkpoint, type "lora": `lora_config.json` and the adapter tensors, full
size whatever the layout); `merge_lora` merges them into the base for export (export/convert.py loads it so, and
export/gates.py lora_merge_gate checks the merge against the adapters as trained)."""
from __future__ import annotations

import json
from pathlib import Path
import math

import numpy as np
from safetensors.numpy import load_file

from core.errors import ConfigError

LORA_CONFIG = "lora_config.json"  # (PaddleNLP's name: a LoRA run's checkpoint holds the adapters alone)


def lora_config(config, tensor_parallel_degree: int):
    from paddlenlp.peft import LoRAConfig

    f = config.finetune
    return LoRAConfig(target_modules=list(f.lora_targets), r=f.lora_rank, lora_alpha=f.lora_alpha,
                      trainable_modules=list(f.lora_trainable) or None,
                      merge_weights=False, tensor_parallel_degree=tensor_parallel_degree, dtype="float32",
                      base_model_name_or_path=config.model.init_from)


def wrap(config, model, tensor_parallel_degree: int):
    """`model` with adapters on finetune.lora_targets, finetune.lora_trainable trained whole, every other weight
    frozen."""
    from paddlenlp.peft import LoRAModel

    wrapped = LoRAModel(model, lora_config(config, tensor_parallel_degree))
    wrapped.mark_only_lora_as_trainable()
    if not parameter_counts(wrapped)[0]:
        raise ConfigError(f"finetune.lora_targets={config.finetune.lora_targets}: no layer of the model matches")
    return wrapped


def parameter_counts(model) -> tuple[int, int]:
    """(trainable, all) parameters of this rank's model. From shapes: numel() of the semi-automatic API's
    distributed tensors crashes the process (Paddle 2.6.2)."""
    sizes = [(math.prod(p.shape), not p.stop_gradient) for p in model.parameters()]
    return sum(n for n, trainable in sizes if trainable), sum(n for n, _ in sizes)


def lora_base(checkpoint: Path) -> Path:
    """The base model a LoRA checkpoint's adapters belong to (its lora_config.json, written from model.init_from)."""
    settings = json.loads((Path(checkpoint) / LORA_CONFIG).read_text())
    base = Path(settings.get("base_model_name_or_path") or "")
    if not (base / "config.json").is_file():
        raise ConfigError(f"{checkpoint} holds LoRA adapters for the base model {base}, which is not on this machine; "
                          "export where the fine-tuning run's base is (its model.init_from)")
    return base


def lora_scaling(settings: dict) -> float:
    """PaddleNLP's LoRALinear scaling (2.8.1): alpha / r, or alpha / sqrt(r) with rslora."""
    r, alpha = settings["r"], settings["lora_alpha"]
    return alpha / (r ** 0.5) if settings.get("rslora") else alpha / r


def merge_lora(model, checkpoint: Path) -> int:
    """W += A @ B * scaling for every adapter pair of the checkpoint (Paddle's Linear weight is [in, out], A [in, r],
    B [r, out], as LoRALinear computes x @ W + x @ A @ B * scaling), and the weights trained whole beside them
    (finetune.lora_trainable, e.g. the LM head) copied in; returns how many weights were changed."""
    import paddle

    settings, adapters = read_lora(checkpoint)
    weights = model.state_dict()
    scaling = lora_scaling(settings)
    merged = 0
    for name, value in adapters.items():
        if name.endswith(".lora_B"):
            continue
        target = name[:-len(".lora_A")] + ".weight" if name.endswith(".lora_A") else name
        if target not in weights or (target == name and tuple(weights[target].shape) != value.shape):
            raise ConfigError(f"{checkpoint}: adapter {name} has no weight {target} of its shape in the base model")
        weight = weights[target]
        if target == name:  # (a weight trained whole)
            weight.set_value(paddle.to_tensor(value.astype(np.float32)))
        else:
            delta = value.astype(np.float64) @ adapters[name[:-1] + "B"].astype(np.float64) * scaling
            weight.set_value(paddle.to_tensor((weight.numpy().astype(np.float64) + delta).astype(np.float32)))
        merged += 1
    return merged


def read_lora(checkpoint: Path) -> tuple[dict, dict]:
    """(lora_config.json, {name: array}) of a LoRA checkpoint: the adapters and the weights trained whole."""
    settings = json.loads((Path(checkpoint) / LORA_CONFIG).read_text())
    adapters: dict = {}
    for path in sorted(Path(checkpoint).glob("peft_model*.safetensors")):
        adapters.update(load_file(str(path)))
    if not adapters:
        raise ConfigError(f"{checkpoint}: a LoRA checkpoint without adapter weights (peft_model*.safetensors)")
    return settings, adapters


def as_trained(checkpoint: Path):
    """The LoRA checkpoint as it trained: PaddleNLP's LoRAModel (adapters unmerged) over its base, in eval mode."""
    from paddlenlp.peft import LoRAModel

    from model.llama import load_merged

    model = LoRAModel.from_pretrained(load_merged(lora_base(checkpoint)), str(checkpoint))
    model.eval()
    return model
