"""VisualDL, Paddle's training dashboard, for every run (docs/monitoring.md): `runs/<run>/visualdl/`.

    train/     rank 0: the numbers MLflow gets (training/metrics/mlflow_logger.py MlflowLogger hands each one here too): loss,
               learning rate, tokens/s, step time, eval loss and perplexity, checkpoint stall; the run's settings as
               hparams (runs of a sweep compare on one page)
    stage-<k>/ a pipeline run, one writer per stage (its first tensor / data replica): forward, backward, step and
               idle ms of each step (training/metrics/stage_timing.py), the same tags on every stage, so that the stages are
               lines of one chart
    pipeline/  written by the launcher at the run's end (training/metrics/stage_report.py): the stage imbalance of each
               step (slowest stage's compute / the mean), from the stage writers' own records

Exactly once across a kill and a resume: a writer writes and flushes its records at each logging step's end (each
step's call costs the loop ~2 ms on 2 busy cores, an interval's batch about the same once) and as every checkpoint
starts (so all the steps a resume starts after are on disk); a resumed launch (which trains the steps after its
checkpoint again, with the same numbers: resumes are exact) first reads what its directory holds and writes only the
steps after the newest one there. So a curve never goes back, never
repeats a step and has no gap, whatever killed the run and wherever.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
import resource

from paddlenlp.trainer import TrainerCallback

from training.metrics.visualdl_layout import LOGDIR, new_file_name, read_scalars, tag_of

COST_FILE = "writer_cost.json"


class VisualDLWriter(TrainerCallback):
    """Scalars of one writer directory, written (and flushed) at each step's end; a resumed launch skips the steps
    its directory already holds (see the module's docstring)."""

    def __init__(self, logdir: Path, hparams: dict | None = None, metrics: tuple = ()):
        self.logdir, self.hparams, self.metrics = Path(logdir), hparams, metrics
        self.pending: list[tuple[str, float, int]] = []
        self.lock = threading.Lock()
        self.writer = None
        self.floor = -1  # the newest step already in the directory (an earlier launch's): not written again
        self.written = 0
        self.spent_s, self.steps = 0.0, 0  # the writer's own time in the training loop (bench/monitor_cost.py)

    def add(self, tag: str, value: float, step: int) -> None:
        with self.lock:
            self.pending.append((tag, float(value), int(step)))

    def add_metrics(self, metrics: dict, step: int) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.add(tag_of(key), value, step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.hparams is not None and logs and "loss" in logs:  # (the run's writer: this process's memory too)
            self.add("memory/max_rss_mib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                     state.global_step)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        began = time.perf_counter()
        if state.global_step % max(1, getattr(args, "logging_steps", 1)) == 0:  # (written at the logging steps: a
            self.write()  # kill loses at most one interval's records, which the resume writes: see the floor)
        self.spent_s, self.steps = self.spent_s + time.perf_counter() - began, self.steps + 1
        return control

    def write_before_checkpoint(self) -> None:
        """Called as a checkpoint starts (training/rank.py _save_checkpoint): everything up to its step is on disk
        before the checkpoint can complete -- a resume from it logs only the steps after it, so a record still held
        at a kill would be a gap."""
        self.write()

    def on_train_end(self, args, state, control, **kwargs):
        self.write()
        self.close()
        if self.steps:  # (what the writer cost this launch's loop, beside its logs; VisualDL reads only vdlrecords.*)
            (self.logdir / COST_FILE).write_text(json.dumps({"steps": self.steps, "seconds": self.spent_s,
                                                             "records": self.written}))
        return control

    def write(self) -> None:
        """The held records, in step order, flushed to disk; those of steps an earlier launch wrote are dropped."""
        with self.lock:
            ready, self.pending = self.pending, []
        if not ready:
            return
        writer = self._writer()
        fresh = sorted((r for r in ready if r[2] > self.floor), key=lambda r: r[2])
        for tag, value, at in fresh:
            writer.add_scalar(tag, value, at)
        writer.flush()
        self.written += len(fresh)

    def _writer(self):
        if self.writer is None:
            from visualdl import LogWriter

            earlier = read_scalars(self.logdir) if self.logdir.is_dir() else {}
            self.floor = max((max(steps) for steps in earlier.values() if steps), default=-1)
            self.logdir.mkdir(parents=True, exist_ok=True)
            self.writer = LogWriter(logdir=str(self.logdir), file_name=new_file_name())
            if not earlier and self.hparams:  # (once per run: a resume continues the same charts)
                self.writer.add_hparams(self.hparams, list(self.metrics))
        return self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class StageWriter(VisualDLWriter):
    """A pipeline stage's per-step times (training/metrics/stage_timing.py StageTimer.last) as `stage/*` scalars."""

    def __init__(self, logdir: Path):
        super().__init__(logdir)
        self.source = lambda: None  # () -> the StageTimer (it exists once the Trainer wrapped the model: rank.py)

    def on_step_end(self, args, state, control, **kwargs):
        began = time.perf_counter()
        timer = self.source()
        last = timer.take_last() if timer is not None else None
        if last:
            for name, ms in last.items():
                self.add(f"stage/{name}", ms, state.global_step)
        self.spent_s += time.perf_counter() - began
        return super().on_step_end(args, state, control, **kwargs)


def hparams(m, t, p) -> dict:
    """The settings a sweep varies (of the model, training and parallel sections), as VisualDL's hparams (scalars
    and short strings only)."""
    return {"learning_rate": t.learning_rate, "hidden_size": m.hidden_size, "num_layers": m.num_layers,
            "seq_length": t.seq_length, "global_batch_size": t.global_batch_size, "max_steps": t.max_steps,
            "layout": f"dp{p.data}-tp{p.tensor}-pp{p.pipeline}-sh{p.sharding_degree}"}


def stage_writer_rank() -> int | None:
    """This rank's pipeline stage when it is the stage's writer (its first tensor, data and sharding replica)."""
    from paddle.distributed import fleet

    hcg = fleet.get_hybrid_communicate_group()
    first = hcg.get_data_parallel_rank() == 0 and hcg.get_model_parallel_rank() == 0 and \
        hcg.get_sharding_parallel_rank() == 0
    return hcg.get_stage_id() if first else None
