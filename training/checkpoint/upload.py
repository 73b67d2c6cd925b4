"""Complete checkpoints to the object store (`storage.uri`), in the background on rank 0: training never waits.

A checkpoint is queued once it is complete on local disk (manager.py). One thread uploads its files (core/storage.py
upload_tree: several at once), then its completion record, written last and only if absent (in_store.py), so a reader
of the store never takes a partial checkpoint. Retention (training.keep_checkpoints: the newest N and the best by the
export metric) applies in the store after each upload, only while this run's launcher holds the writer lease
(lease.py). While the store is down the thread retries with backoff, cut short when a newer checkpoint is queued;
the console says so once, naming the cause (unreachable, credentials refused, permission denied), and again when it
is back. At most `max_pending` checkpoints wait, a newer one replacing the oldest waiting. At the end of the run the
rank waits up to `storage.upload_wait_s` and names what is still missing.

Nodes that share no filesystem (storage.shared_filesystem=false): each node's first rank uploads its node's part
(the files its ranks wrote on its disk), then the part's record (`.parts/node-<k>.json`). Whichever node finds every
part there writes the completion record (node 0's record, conditionally: one writer wins) and applies retention.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from core.storage import Store, describe
from training.metrics import progress
from training.checkpoint import lease
from training.checkpoint.local import COMPLETE_MARKER, DONE_MARKER_PREFIX
from training.checkpoint.in_store import checkpoints_prefix, mark_complete_in_store, part_key, retain

BACKOFF_S = (0.5, 1, 2, 4, 8, 15, 30)
UPLOADED = "store: uploaded"  # (the rank log's line per checkpoint: the bench reads MB/s from it)


class StoreUploader:
    def __init__(self, store: Store, run_dir: Path, keep: int, metric: str, max_pending: int = 2, node: int = 0,
                 nnodes: int = 1):
        self.store = store
        self.node, self.nnodes = node, nnodes  # (nnodes > 1: this node's part only; the nodes share no disk)
        self.run_dir, self.run_name, self.keep, self.metric = run_dir, run_dir.name, keep, metric
        self.max_pending = max_pending
        self.writer = os.environ.get(lease.WRITER_ENV, "")
        self.waiting: list[tuple[Path, dict]] = []
        self.submitted = 0
        self.current: Path | None = None
        self.cond = threading.Condition()
        self.down_since: float | None = None
        self.bucket_checked = False
        self.cause = ""  # (the last failure, named: store_missing.json and the end-of-run line carry it)
        self.thread = threading.Thread(target=self._run, name="store-upload", daemon=True)
        self.thread.start()

    def submit(self, checkpoint: Path, info: dict) -> None:
        with self.cond:
            if len(self.waiting) >= self.max_pending:
                dropped, _ = self.waiting.pop(0)
                self._note(f"store: {dropped.name} not uploaded: {checkpoint.name} replaces it in the queue "
                           f"(storage.max_pending={self.max_pending})")
            self.waiting.append((checkpoint, info))
            self.submitted += 1
            self.cond.notify_all()

    def uploading(self) -> set[str]:
        """Checkpoint paths queued or being uploaded (retention on disk must keep them)."""
        with self.cond:
            return {str(p.resolve()) for p, _ in self.waiting} | ({str(self.current.resolve())} if self.current else set())

    def what(self) -> str:
        return "every checkpoint" if self.nnodes == 1 else f"node {self.node}'s part of every checkpoint"

    def finish(self, wait_s: float) -> list[str]:
        """Wait up to `wait_s` for the queue to empty; the checkpoints still missing in the store."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            if (self.waiting or self.current) and wait_s > 0:
                print(f"store: waiting up to {wait_s:g}s (storage.upload_wait_s) for "
                      f"{len(self.waiting) + bool(self.current)} checkpoint(s) to reach {self.store.uri}", flush=True)
            while (self.waiting or self.current) and time.monotonic() < deadline:
                self.cond.wait(min(1.0, max(deadline - time.monotonic(), 0.01)))
            return [p.name for p, _ in self.waiting] + ([self.current.name] if self.current else [])

    # -- the thread ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.waiting:
                    self.cond.wait()
                checkpoint, info = self.waiting.pop(0)
                self.current = checkpoint
            self._upload_until_done(checkpoint, info)
            with self.cond:
                self.current = None
                self.cond.notify_all()

    def _upload_until_done(self, checkpoint: Path, info: dict) -> None:
        for attempt in range(10**9):
            if not checkpoint.is_dir():  # (removed meanwhile: nothing left to upload)
                return
            try:
                self._upload(checkpoint, info)
                if self.down_since is not None:
                    self._note(f"store: reachable again after {time.time() - self.down_since:.0f}s; "
                               f"{checkpoint.name} uploaded")
                    self.down_since, self.cause = None, ""
                return
            except Exception as exc:  # noqa: BLE001  (any store failure: retried, training goes on)
                kind, text = describe(exc)
                if self.down_since is None or text != self.cause:
                    self.down_since = self.down_since or time.time()
                    self._note(f"store: {self.store.name()}: {text}; retrying {checkpoint.name} with backoff, "
                               "training goes on")
                self.cause = text
                with self.cond:  # (a newer checkpoint queued meanwhile cuts the wait short: a store that is back
                    # catches up within one save interval, not a whole backoff step)
                    submitted = self.submitted
                    self.cond.wait_for(lambda: self.submitted != submitted, BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])

    def _upload(self, checkpoint: Path, info: dict) -> None:
        prefix = f"{checkpoints_prefix(self.store, self.run_name)}/{checkpoint.name}"
        if not self.bucket_checked:  # (the launcher's check made it; ranks started by hand may not have one)
            self.store.ensure_bucket()
            self.bucket_checked = True
        if self.store.read(f"{prefix}/{COMPLETE_MARKER}") is not None:
            return  # (uploaded before an interruption)
        began = time.monotonic()
        part = part_key(self.store, self.run_name, checkpoint.name, self.node)
        size = 0
        if self.nnodes == 1 or self.store.read(part) is None:
            size = self.store.upload_tree(checkpoint, prefix, lambda relative: relative == COMPLETE_MARKER
                                          or relative.startswith(DONE_MARKER_PREFIX))
        if self.nnodes > 1:
            self.store.put(part, json.dumps(info).encode())
            info = self._all_parts(checkpoint.name)
        seconds = time.monotonic() - began
        print(f"{UPLOADED} {checkpoint.name}: {size / 2**20:.2f} MB in {seconds:.3f}s", flush=True)  # (rank log)
        step = int(checkpoint.name.split("-")[1])
        if info is not None and mark_complete_in_store(self.store, self.run_name, step, info):
            if self.keep > 0 and self.writer and not lease.holds(self.store, self.run_name, self.writer):
                self._note(f"store: this launch no longer holds {self.run_name}'s writer lease: retention left to "
                           "the holder")
                return
            retain(self.store, self.run_name, self.keep, self.metric)

    def _all_parts(self, name: str) -> dict | None:
        """Node 0's record of the checkpoint once every node's part is in the store; None while one is missing."""
        records = [self.store.read(part_key(self.store, self.run_name, name, k)) for k in range(self.nnodes)]
        return None if any(r is None for r in records) else json.loads(records[0])

    def _note(self, text: str) -> None:
        print(text, flush=True)
        progress.note(self.run_dir, text)

