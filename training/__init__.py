"""Training stage: data and tokenizer, model, CPU gloo layer, Trainer callbacks, the per-rank worker."""
import pipeline  # noqa: F401  (loads zlib before paddle; see pipeline/__init__.py)
