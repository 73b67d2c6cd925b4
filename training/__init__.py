"""Training stage: `make data`'s preparation and what a rank reads (data/), a run's launcher (launch/), one rank's
Trainer (rank.py) with its callbacks, checkpoints and asynchronous writes (checkpoint/), what a run records (metrics/),
fine-tuning's data and LoRA (finetune/), semi-automatic parallel. The model is model/llama.py's; platform patches are
core/workarounds/'s."""
import core  # noqa: F401  (loads zlib before paddle; see core/__init__.py)
