"""Training stage: `make data`'s preparation and what a rank reads (data/), one rank's Trainer (rank.py) with its
callbacks, checkpoints and asynchronous writes, semi-automatic parallel, progress and pipeline stage timing. The model
is model/llama.py's; platform patches are core/workarounds/'s."""
import core  # noqa: F401  (loads zlib before paddle; see core/__init__.py)
