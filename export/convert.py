"""A unified (full-tensor) checkpoint of any layout -> the single-device dynamic model, and its forward as numpy."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from core.errors import ConfigError
from training.finetune.lora import LORA_CONFIG, lora_base, merge_lora


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
