"""Training stage: data and tokenizer, model, CPU gloo layer, Trainer callbacks, the per-rank worker."""
import core  # noqa: F401  (loads zlib before paddle; see core/__init__.py)
