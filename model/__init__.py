"""The model (model/llama.py): imported by training, export and evaluation."""
import core  # noqa: F401  (zlib before paddle)
