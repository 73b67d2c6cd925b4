"""LoRA fine-tuning (finetune.method=lora): PaddleNLP's `LoRAModel` around this rank's model, only the adapters
trainable. PaddleNLP's Trainer saves a LoRA model's checkpoint as the adapters alone (unified checkpoint, type
"lora": `lora_config.json` and the adapter tensors, full size whatever the layout); export merges them into the base
(export/convert.py)."""
from __future__ import annotations


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

    from core.errors import ConfigError

    wrapped = LoRAModel(model, lora_config(config, tensor_parallel_degree))
    wrapped.mark_only_lora_as_trainable()
    if not parameter_counts(wrapped)[0]:
        raise ConfigError(f"finetune.lora_targets={config.finetune.lora_targets}: no layer of the model matches")
    return wrapped


def parameter_counts(model) -> tuple[int, int]:
    """(trainable, all) parameters of this rank's model. From shapes: numel() of the semi-automatic API's
    distributed tensors crashes the process (Paddle 2.6.2)."""
    import math

    sizes = [(math.prod(p.shape), not p.stop_gradient) for p in model.parameters()]
    return sum(n for n, trainable in sizes if trainable), sum(n for n, _ in sizes)
