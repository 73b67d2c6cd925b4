"""A unified (full-tensor) checkpoint of any layout -> the single-device dynamic model, and its forward as numpy."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from core.errors import ConfigError


LORA_CONFIG = "lora_config.json"  # (PaddleNLP's name: a LoRA run's checkpoint holds the adapters alone)


def load_checkpoint(checkpoint: Path):
    """The single-device dynamic model of a unified (full-tensor) checkpoint of any layout, in eval mode; a LoRA
    checkpoint's adapters merged into its base model's weights."""
    import paddle

    from model.llama import load_merged

    paddle.set_device("cpu")
    lora = Path(checkpoint) / LORA_CONFIG
    try:
        if lora.is_file():
            model = load_merged(lora_base(checkpoint))
            merge_lora(model, checkpoint)
        else:
            model = load_merged(checkpoint)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001  (safetensors / json / paddle errors on a damaged checkpoint)
        raise ConfigError(f"checkpoint {checkpoint} is unreadable ({exc.__class__.__name__}: "
                          f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); pick another run or RUN_ID") from None
    model.eval()
    return model


def logits_only(model):
    import paddle

    class LogitsOnly(paddle.nn.Layer):
        """input_ids -> logits (the model itself returns a tuple / ModelOutput)."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids, use_cache=False, return_dict=False)[0]

    return LogitsOnly(model)


def dynamic_forward(model):
    """forward(ids[B, T]) -> logits[B, T, V] of the dynamic model, as numpy (what generation drives)."""
    import paddle

    def forward(ids: np.ndarray) -> np.ndarray:
        with paddle.no_grad():
            return logits_only(model)(paddle.to_tensor(ids)).numpy()

    return forward


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
    from safetensors.numpy import load_file

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
