"""The checkpoint manager of a rank: a Trainer callback that owns what happens after PaddleNLP writes
`checkpoint-<step>/`: durability, the completion marker, retention on disk, the upload to the store and the record
in MLflow. `for_rank` builds it from the config.

Synchronous saves: every rank fsyncs, a barrier, the owner marks. Asynchronous saves (`writer`, async_write.py): each
rank's writer thread, once its files are written and fsynced, leaves a `.done-rank<r>` marker in the checkpoint; the
owner's writer waits for the markers of all its peers (no collective: the training loop owns those) and marks the
checkpoint complete. A checkpoint killed half-way is never marked. Each save's pause of the training loop is logged
as `checkpoint_stall_s`. The owner is rank 0, or, when the nodes share no filesystem, each node's first rank for its
node's part on its own disk (the store then says when the checkpoint is whole: upload.py).

At the end of the run the owner waits for the uploads (`storage.upload_wait_s`); checkpoints that did not reach the
store are written to `store_missing.json` in the run directory, which the launcher turns into the MLflow tag
`pipeline.store_missing` and exit code 4 (training/launch/train_run.py).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from paddlenlp.trainer import TrainerCallback  # (this import resets SIGTERM: handlers are installed after it)

from core import tracking
from training.metrics import progress
from training.checkpoint.local import (DONE_MARKER_PREFIX, checkpoint_info, complete_checkpoints, make_durable,
                                       mark_complete, prune)
from training.checkpoint.in_store import record_missing
from core.storage import Store
from training.checkpoint import async_write
from training.checkpoint.upload import StoreUploader


def checkpoint_roles(storage, layout, rank: int) -> tuple[bool, range]:
    """Whether `rank` marks checkpoints complete, and over which ranks' parts: rank 0 over every rank (one run
    directory), or, when the nodes share no filesystem (storage.shared_filesystem=false), each node's first rank
    over its node's ranks (`--rank NODE_RANK` gives node k the ranks k*n .. k*n+n-1)."""
    if storage.shared_filesystem or layout.nnodes == 1:
        return rank == 0, range(layout.world_size)
    first = rank - rank % layout.procs_per_node
    return rank == first, range(first, first + layout.procs_per_node)


def should_upload(mode: str, metric: str, info: dict, earlier: list[dict]) -> bool:
    """tracking.checkpoint_artifacts: `all` uploads every complete checkpoint, `best` those that improve `metric`
    (lower is better) over every earlier checkpoint of the run, `none` nothing."""
    if mode == "all":
        return True
    if mode != "best" or metric not in info:
        return False
    return all(info[metric] < e[metric] for e in earlier if metric in e)


def for_rank(storage, layout, run_dir: Path, rank: int, mlflow_logger, *, async_save: bool, upload_mode: str,
             metric: str, keep: int) -> "CheckpointManager":
    """This rank's manager: its role, the asynchronous writer (`async_save`: training/checkpoint/async_write.py
    enabled) and, on an owner with storage.uri (`storage`: the config's section), the uploader; `upload_mode`
    (tracking.checkpoint_artifacts), `metric` (export.metric) and `keep` (training.keep_checkpoints) as named."""
    writer = None
    if async_save:
        async_write.apply()
        writer = async_write.writer()
    owner, peers = checkpoint_roles(storage, layout, rank)
    uploader = None
    if storage.uri and owner:
        uploader = StoreUploader(Store.of(storage), run_dir, keep, metric, storage.max_pending,
                                 node=peers.start // len(peers), nnodes=layout.world_size // len(peers))
        for _, path in complete_checkpoints(run_dir)[-storage.max_pending:]:  # (a resume: what an earlier launch
            uploader.submit(path, checkpoint_info(path))  # left un-uploaded; those in the store are skipped)
    return CheckpointManager(mlflow_logger, upload_mode, metric, keep, writer, owner=owner, peers=peers,
                             store=uploader, store_wait_s=storage.upload_wait_s)


class CheckpointManager(TrainerCallback):
    def __init__(self, mlflow_logger, upload_mode: str = "none", metric: str = "eval_loss", keep: int = 0,
                 writer=None, peers_timeout_s: float = 3600.0, store=None, store_wait_s: float = 0,
                 owner: bool = False, peers: range = range(0)):
        self.mlflow_logger, self.upload_mode, self.metric, self.keep = mlflow_logger, upload_mode, metric, keep
        self.writer, self.peers_timeout_s = writer, peers_timeout_s
        self.owner, self.peers = owner, peers  # (checkpoint_roles: who marks, over whose parts)
        self.store, self.store_wait_s = store, store_wait_s  # (upload.py, an owner with storage.uri)
        self.noted = False

    def on_save(self, args, state, control, **kwargs):
        import paddle.distributed as dist

        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        evals = [e for e in state.log_history if "eval_loss" in e and e.get("step") == state.global_step]
        info = {"step": state.global_step, "path": str(checkpoint.resolve()), "saved_at": time.time(),
                **{k: v for k, v in (evals[-1] if evals else {}).items() if k.startswith("eval_")}}
        if "eval_loss" in info:
            info["eval_perplexity"] = tracking.perplexity(info["eval_loss"])
        if self.writer is not None:
            self.writer.check()  # an earlier write failed: stop here, not silently without checkpoints
            self.writer.submit(self._finish, checkpoint, info, dist.get_rank())
        else:
            make_durable(checkpoint)  # each rank: what it wrote reaches the disk before the checkpoint can count
            if dist.get_world_size() > 1:
                dist.barrier()
            if self.owner:
                self._complete(checkpoint, info)
        started = getattr(state, "checkpoint_started_at", None)
        if started and self.mlflow_logger:
            self.mlflow_logger.log_metrics({"checkpoint_stall_s": time.time() - started}, state.global_step)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.check()
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.drain()  # the last checkpoint is complete (or its failure raised) before the rank exits
        if self.store is not None:
            missing = self.store.finish(self.store_wait_s)
            run_dir = Path(args.output_dir).parent
            if missing:
                cause = self.store.cause or "still uploading"
                text = (f"store: not uploaded within storage.upload_wait_s={self.store_wait_s:g}s: {', '.join(missing)}"
                        f" ({cause}; complete on local disk; a resume from this disk uploads them)")
                record_missing(run_dir, missing, cause)
            else:
                text = f"store: {self.store.what()} is in {self.store.store.uri}"
            print(text, flush=True)
            progress.note(run_dir, text)

    def _finish(self, checkpoint: Path, info: dict, rank: int) -> None:
        """In the rank's writer thread, after its files of this checkpoint are written and fsynced."""
        make_durable(checkpoint)
        checkpoint.mkdir(parents=True, exist_ok=True)  # (a rank with nothing to save, on a disk of its own)
        marker = checkpoint / f"{DONE_MARKER_PREFIX}{rank}"
        with open(marker, "w") as fh:
            fh.write(str(time.time()))
            fh.flush()
            os.fsync(fh.fileno())
        if not self.owner:
            return
        deadline = time.time() + self.peers_timeout_s
        while not all((checkpoint / f"{DONE_MARKER_PREFIX}{r}").exists() for r in self.peers):
            if time.time() > deadline:
                raise TimeoutError(f"{checkpoint}: not every rank finished writing within {self.peers_timeout_s:g}s")
            time.sleep(0.05)
        self._complete(checkpoint, info)

    def _complete(self, checkpoint: Path, info: dict) -> None:
        """The owner: mark complete, apply retention, queue the upload, record (and maybe upload) in MLflow."""
        checkpoint.mkdir(parents=True, exist_ok=True)  # (a node whose ranks had nothing to save, on its own disk)
        earlier = [checkpoint_info(path) for step, path in complete_checkpoints(checkpoint.parent.parent)
                   if step != info["step"]] if self.upload_mode == "best" else []
        mark_complete(checkpoint, info)
        uploading = (self.mlflow_logger.uploading() if self.mlflow_logger else set()) | \
            (self.store.uploading() if self.store else set())
        removed = prune(checkpoint.parent.parent, self.keep, self.metric, info["step"], uploading)
        if removed:
            print(f"checkpoints: removed {', '.join(p.name for p in removed)}", flush=True)
            if not self.noted:  # (the console hears it once; the rank log every time)
                self.noted = True
                progress.note(checkpoint.parent.parent, f"checkpoints: keeping the newest {self.keep} and the best by "
                              f"{self.metric} (training.keep_checkpoints); older ones are removed as new ones "
                              f"complete")
        if self.store is not None:
            self.store.submit(checkpoint, info)
        if self.mlflow_logger:
            self.mlflow_logger.log_checkpoint(info, should_upload(self.upload_mode, self.metric, info, earlier))
