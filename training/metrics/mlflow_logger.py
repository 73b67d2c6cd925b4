"""What a rank records: MLflow (PaddleNLP 2.8.1 has no MLflow integration) and each rank's peak memory and parameter
counts. (VisualDL's writers: visualdl_writers.py; the console's events: progress.py.)"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
import resource

from paddlenlp.trainer import TrainerCallback  # (this import resets SIGTERM: the graceful stop installs after it)

from core import tracking
from training.metrics import progress
from training.finetune.lora import parameter_counts


class MlflowLogger(TrainerCallback):
    """Rank 0 only: per-logging-step metrics, eval metrics and checkpoint records into the launcher's MLflow run.

    Records are sent in order by a background thread, so neither a slow tracking server nor a checkpoint upload
    stalls training; at most `max_uploads` checkpoint uploads wait in the queue (a save beyond that waits for the
    oldest), and the end of training waits for the queue to drain. If the tracking server goes away mid-run, training
    goes on: records that could not be sent are kept and re-sent, in order, with the next attempt. Whatever is still
    unsent when training ends is written to `<run dir>/unsent_records.jsonl` and named in a warning (the launcher
    process retries it once more)."""

    RETRY_S = 5.0

    def __init__(self, client, run_id: str, seq_length: int, run_dir: Path, max_uploads: int = 2, mirror=None):
        self.client, self.run_id, self.seq_length, self.run_dir = client, run_id, seq_length, run_dir
        self.mirror = mirror  # (metrics, step) -> None: VisualDL's writer gets the same numbers (training/metrics/visualdl_writers.py)
        self.max_uploads = max_uploads
        self.pending: list[dict] = []  # not yet handed to the sender
        self.sending: list[dict] = []  # the sender's current batch
        self.failing = False
        self.lock = threading.Condition()
        self.closed = False
        self.sender = threading.Thread(target=self._loop, name="mlflow-sender", daemon=True)
        self.sender.start()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
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
            metrics["eval_perplexity"] = tracking.perplexity(logs["eval_loss"])
        for key in ("train_runtime", "train_loss", "train_samples_per_second", "train_steps_per_second",
                    *tracking.PREFERENCE_METRICS, *(f"eval_{name}" for name in tracking.PREFERENCE_METRICS)):
            if key in logs:
                metrics[key] = logs[key]
        metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        self._enqueue([tracking.metric_record(k, v, step, now) for k, v in metrics.items()])
        if self.mirror:
            self.mirror(metrics, step)

    def log_metrics(self, metrics: dict, step: int) -> None:
        now = int(time.time() * 1000)
        self._enqueue([tracking.metric_record(k, v, step, now) for k, v in metrics.items()])
        if self.mirror:
            self.mirror(metrics, step)

    def log_checkpoint(self, info: dict, upload: bool) -> None:
        # The record (path + metrics, + the artifact path once uploaded) lets export find the best checkpoint from
        # the run alone.
        with self.lock:
            while upload and self._queued_uploads() >= self.max_uploads and self.sender.is_alive() \
                    and not self.failing:
                self.lock.wait(1.0)  # bounded queue: a save waits for the oldest upload, not for all of them
        self._enqueue([tracking.checkpoint_record(info, upload)])

    def uploading(self) -> set[str]:
        """Checkpoint paths whose upload has not finished (retention must not delete them yet)."""
        with self.lock:
            return {r["info"]["path"] for r in self._uploads()}

    def _queued_uploads(self) -> int:
        return len(self._uploads())

    def _uploads(self) -> list[dict]:
        """The checkpoint records still to upload (caller holds the lock)."""
        return [r for r in self.sending + self.pending if r["kind"] == "checkpoint" and r["upload"]]

    def _enqueue(self, records: list[dict]) -> None:
        with self.lock:
            self.pending += records
            self.lock.notify_all()

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.pending and not self.closed:
                    self.lock.wait()
                if not self.pending:
                    return
                self.sending, self.pending = self.pending, []
            batch = list(self.sending)
            try:
                tracking.send_records(self.client, self.run_id, batch)  # removes what it sent from `batch`
                ok = True
            except Exception as exc:  # noqa: BLE001  (any transport error: keep training, keep the records)
                ok = False
                if not self.failing:
                    progress.note(self.run_dir, f"[mlflow] WARNING: logging failed ({exc.__class__.__name__}); "
                                  f"training continues, metrics and checkpoint records are buffered and re-sent")
            with self.lock:
                self.pending = batch + self.pending  # what is left of the batch goes first next time
                self.sending = []
                if ok and self.failing:
                    progress.note(self.run_dir, "[mlflow] tracking server reachable again; buffered records sent")
                self.failing = not ok
                self.lock.notify_all()
                if not ok:
                    if self.closed:
                        return
                    self.lock.wait(self.RETRY_S)

    def flush(self, timeout_s: float = 600.0) -> None:
        """Wait until everything queued is sent (or the sender gives up), then stop the sender."""
        with self.lock:
            self.closed = True
            self.lock.notify_all()
        self.sender.join(timeout_s)

    def on_train_end(self, args, state, control, **kwargs):
        self.flush()
        with self.lock:
            unsent, self.pending, self.sending = self.sending + self.pending, [], []
        if unsent:
            tracking.save_unsent(self.run_dir, unsent)
            progress.note(self.run_dir, f"[mlflow] WARNING: {len(unsent)} records could not be sent; kept in "
                          f"{self.run_dir / tracking.UNSENT_RECORDS}")


class PeakMemory(TrainerCallback):
    """Each rank's peak tensor memory over its first training step (parameters, gradients, optimizer states,
    activations; before any evaluation), from Paddle's allocator statistics -- the figure `make plan`'s memory
    model estimates -- and its trainable / total parameters. Written to <run>/memory/rank<r>.json and printed
    ("peak memory: ...")."""

    def __init__(self, run_dir: Path, device: str):
        self.out = Path(run_dir) / "memory"
        self.device = device
        self.done = False

    def on_step_end(self, args, state, control, **kwargs):
        if self.done or state.global_step < 1:
            return

        import paddle
        from paddle.base import core

        if self.device == "gpu":
            peak = core.device_memory_stat_peak_value("Allocated", paddle.distributed.ParallelEnv().device_id)
        else:
            peak = core.host_memory_stat_peak_value("Allocated", 0)
        rank = paddle.distributed.get_rank()
        record = {"rank": rank, "step": state.global_step, "peak_allocated_bytes": int(peak),
                  "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        model = kwargs.get("model")
        if model is not None:  # (this rank's part: LoRA trains its adapters alone, training/finetune/lora.py)
            record["trainable_parameters"], record["parameters"] = parameter_counts(model)
            print(f"trainable parameters: {record['trainable_parameters']:,} of {record['parameters']:,} "
                  f"({record['trainable_parameters'] / max(record['parameters'], 1):.2%}) on rank {rank}", flush=True)
        self.out.mkdir(exist_ok=True)
        (self.out / f"rank{rank}.json").write_text(json.dumps(record))
        print(f"peak memory: {peak / 2**20:.1f} MiB allocated by tensors (first step), process RSS "
              f"{record['max_rss_bytes'] / 2**20:.0f} MiB", flush=True)
        self.done = True

    def on_train_end(self, args, state, control, **kwargs):
        """The process's peak RSS over the whole run, beside the first step's figures."""
        import paddle

        path = self.out / f"rank{paddle.distributed.get_rank()}.json"
        if path.is_file():
            record = json.loads(path.read_text())
            record["run_max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            path.write_text(json.dumps(record))
