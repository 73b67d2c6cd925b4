"""The verbs of the train-to-serve pipeline (`python -m pipeline <verb>`, one module each) and their orchestration.

Layers (tests/unit/test_layers.py): core/ (shared vocabulary and platform workarounds) at the bottom; the stages
training/ and serving/ above it, neither importing the other; pipeline/ (verbs) and bench/ on top.
"""
import core  # noqa: F401  (zlib and the CPU runtime before anything imports paddle: see core/__init__.py)
from core import REPO_ROOT  # noqa: F401
