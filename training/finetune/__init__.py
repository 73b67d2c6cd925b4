"""Fine-tuning's room: a trained model taught a task with the chat template (docs/finetune.md).

    data.py    the examples: conversations (the built-in review task, or .jsonl) -> fixed-length rows whose loss is on
               the answers only, encoded once per content key
    lora.py    LoRA: PaddleNLP's LoRAModel around a rank's model (training), and the adapters merged into the base
               (export)
    preference.py  preference pairs (finetune.method dpo / simpo): chosen / rejected rows encoded once per content
               key, and the reference model's log-probabilities computed once beside them
    dpo.py     the dpo and simpo losses, their metrics, and the Trainer that computes them

Whether a run is fine-tuning is asked one way: `Config.fine_tuning` (core/config.py); of an export, core/exportdir.py
`fine_tuned`; whether it tunes on pairs: `Config.preference_tuning`. `make finetune` (pipeline/finetune.py) starts the run; the rank (training/rank.py) reads this room's
examples and wraps its model here."""
