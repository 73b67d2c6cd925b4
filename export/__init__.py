"""Export: a unified checkpoint -> the export directory serving runs (core/exportdir.py is its format).

    convert      the checkpoint's single-device dynamic model (model/llama.py load_merged)
    programs     its static programs: the full-sequence graph, prefill and decode (model/llama.py's cached step)
    gates        parity of every program with the dynamic model (logits, greedy tokens), of a fused checkpoint
                 with its unfused form, and of the MLflow model with the graph
    mlflow_model the export directory as an MLflow `python_function` model (serving/offline/pyfunc.py loads it)

Selecting the checkpoint, publishing and registering are the verb's (pipeline/export.py). Export checks what it
writes with serving's own runtime, so this package sits above serving and training.
"""
import core  # noqa: F401  (zlib before paddle)
from core.errors import ConfigError


class ExportError(ConfigError):
    """A reason the export cannot proceed; nothing has been published."""
