"""Fine-tuning's room: a trained model taught a task with the chat template (docs/finetune.md).

    data.py    the examples: conversations (the built-in review task, or .jsonl) -> fixed-length rows whose loss is on
               the answers only, encoded once per content key
    lora.py    LoRA: PaddleNLP's LoRAModel around a rank's model (training), and the adapters merged into the base
               (export)

Whether a run is fine-tuning is asked one way: `Config.fine_tuning` (core/config.py); of an export, core/exportdir.py
`fine_tuned`. `make finetune` (pipeline/finetune.py) starts the run; the rank (training/rank.py) reads this room's
examples and wraps its model here."""
