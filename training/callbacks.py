"""Trainer callbacks: MLflow logging (PaddleNLP 2.8.1 has no MLflow integration) and checkpoint completion."""
from __future__ import annotations

import math
import time
from pathlib import Path

from paddlenlp.trainer import TrainerCallback

from pipeline.tracking import CHECKPOINT_ARTIFACTS
from training.checkpoints import mark_complete


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
    """Rank 0 only: per-logging-step metrics and eval metrics into the MLflow run the launcher created."""

    def __init__(self, client, run_id: str, seq_length: int):
        self.client, self.run_id, self.seq_length = client, run_id, seq_length

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
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if isinstance(v, (int, float))]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def log_checkpoint(self, info: dict) -> None:
        # The artifact is a reference (path + metrics): export finds the best checkpoint from the run alone.
        self.client.log_dict(self.run_id, info, f"{CHECKPOINT_ARTIFACTS}/checkpoint-{info['step']}.json")


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
