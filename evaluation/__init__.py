"""Evaluation, a room of its own: a registered version judged on a fixed held-out set (held_out.py), by losses of its
exported graph, the task's accuracy and the answers to fixed prompts (measures.py), recorded in MLflow beside the
version (record.py). `make evaluate` (pipeline/evaluate.py) runs it; the smoke test grades served answers with the
same `measures.task_accuracy`."""
import core  # noqa: F401  (loads zlib before paddle; see core/__init__.py)
