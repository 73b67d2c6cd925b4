"""Trainer callbacks: MLflow logging (PaddleNLP 2.8.1 has no MLflow integration) and checkpoint completion."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from paddlenlp.trainer import TrainerCallback

from pipeline.tracking import CHECKPOINT_ARTIFACTS
from training.checkpoints import mark_complete

UNSENT_METRICS = "unsent_metrics.jsonl"


class FinalStepCallback(TrainerCallback):
    """Evaluate and save at the last step too, so the final weights are always a complete, rated checkpoint
    (PaddleNLP's DefaultFlowCallback only saves on multiples of save_steps)."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_evaluate = True
            control.should_save = True
        return control


class CheckpointCompleteCallback(TrainerCallback):
    """After every rank has written checkpoint-<step>, rank 0 marks it complete and records it in MLflow."""

    def __init__(self, mlflow_logger: "MlflowLogger | None"):
        self.mlflow_logger = mlflow_logger

    def on_save(self, args, state, control, **kwargs):
        import paddle.distributed as dist

        if dist.get_world_size() > 1:
            dist.barrier()
        if state.is_world_process_zero:
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            evals = [e for e in state.log_history if "eval_loss" in e and e.get("step") == state.global_step]
            info = {"step": state.global_step, "path": str(checkpoint.resolve()), "saved_at": time.time(),
                    **{k: v for k, v in (evals[-1] if evals else {}).items() if k.startswith("eval_")}}
            if "eval_loss" in info:
                info["eval_perplexity"] = _perplexity(info["eval_loss"])
            mark_complete(checkpoint, info)
            if self.mlflow_logger:
                self.mlflow_logger.log_checkpoint(info)
        return control


class MlflowLogger(TrainerCallback):
    """Rank 0 only: per-logging-step metrics and eval metrics into the MLflow run the launcher created.

    If the tracking server goes away mid-run, training goes on: metrics that could not be sent are kept in memory
    and re-sent, in order, with the next successful call. Whatever is still unsent when training ends is written to
    `<run dir>/unsent_metrics.jsonl` and named in a warning (the launcher process retries it once more)."""

    def __init__(self, client, run_id: str, seq_length: int, run_dir: Path):
        self.client, self.run_id, self.seq_length = client, run_id, seq_length
        self.unsent_file = run_dir / UNSENT_METRICS
        self.pending: list = []
        self.failing = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        from mlflow.entities import Metric

        step, now = int(state.global_step), int(time.time() * 1000)
        metrics = {}
        if "loss" in logs:
            metrics["loss"] = logs["loss"]
            metrics["learning_rate"] = logs.get("learning_rate", 0.0)
        if logs.get("interval_samples_per_second"):
            # The Trainer's interval sample rate counts the global batch, so this is the global token rate.
            metrics["tokens_per_second"] = logs["interval_samples_per_second"] * self.seq_length
        if logs.get("interval_steps_per_second"):
            metrics["step_time_s"] = 1.0 / logs["interval_steps_per_second"]
        if "eval_loss" in logs:
            metrics["eval_loss"] = logs["eval_loss"]
            metrics["eval_perplexity"] = _perplexity(logs["eval_loss"])
        for key in ("train_runtime", "train_loss", "train_samples_per_second", "train_steps_per_second"):
            if key in logs:
                metrics[key] = logs[key]
        self.pending += [Metric(k, float(v), now, step) for k, v in metrics.items() if isinstance(v, (int, float))]
        self._send(lambda: None)

    def log_checkpoint(self, info: dict) -> None:
        # The artifact is a reference (path + metrics): export finds the best checkpoint from the run alone.
        self._send(lambda: self.client.log_dict(self.run_id, info,
                                                f"{CHECKPOINT_ARTIFACTS}/checkpoint-{info['step']}.json"))

    def _send(self, extra) -> None:
        try:
            for i in range(0, len(self.pending), 500):  # MLflow's log_batch limit is 1000 metrics
                self.client.log_batch(self.run_id, metrics=self.pending[i:i + 500])
            self.pending = []
            extra()
            if self.failing:
                print("[mlflow] tracking server reachable again; buffered metrics sent", file=sys.stderr, flush=True)
            self.failing = False
        except Exception as exc:  # noqa: BLE001  (any transport error: keep training, keep the metrics)
            if not self.failing:
                print(f"[mlflow] WARNING: logging failed ({exc.__class__.__name__}); training continues, "
                      f"metrics are buffered and re-sent", file=sys.stderr, flush=True)
            self.failing = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.pending:
            self._send(lambda: None)
        if self.pending:
            with self.unsent_file.open("a") as fh:
                for m in self.pending:
                    fh.write(json.dumps({"key": m.key, "value": m.value, "timestamp": m.timestamp,
                                         "step": m.step}) + "\n")
            print(f"[mlflow] WARNING: {len(self.pending)} metrics could not be sent; kept in {self.unsent_file}",
                  file=sys.stderr, flush=True)


def send_unsent_metrics(client, run_id: str, run_dir: Path) -> int:
    """Retry metrics a worker could not send (called by the launcher at the end of the run)."""
    from mlflow.entities import Metric

    path = run_dir / UNSENT_METRICS
    if not path.exists():
        return 0
    metrics = [Metric(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    for i in range(0, len(metrics), 500):
        client.log_batch(run_id, metrics=metrics[i:i + 500])
    path.unlink()
    return len(metrics)


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
