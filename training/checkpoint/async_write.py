"""Asynchronous checkpoint writes (training.async_checkpoint): the training step does not wait for the disk.

PaddleNLP 2.8.1 has a switch for this (`unified_checkpoint_config: async_save`), but it cannot be trusted with a
checkpoint that must be complete before it counts: `file_save_async_or_sync`
(paddlenlp/trainer/plugins/unified_checkpoint.py) starts one `spawn` process per file with the whole state dict as
its pickled arguments, and nothing waits for those processes but the next save (a 60 s join that only logs on a
timeout): no callback can tell when the files are on disk, and nothing fsyncs them. On one process the switch is
not even read (`save_single_card_checkpoint` always writes synchronously). So this module replaces that function
for every unified-checkpoint file: the state dict is snapshotted to host numpy copies (`.numpy()` copies) before
the step goes on, and one thread per rank writes the files in order, fsyncs them, and then runs what was queued
after them (the rank's completion marker, see manager.py). A write that fails (a full disk) stops
everything queued after it, and the training step that next looks (`check`) raises it.

Applies to PaddleNLP 2.8.1 only (`apply` refuses another version); safetensors only (any other save stays
synchronous).
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import time
from importlib.metadata import version
from core.files import fsync_path

SUPPORTED_PADDLENLP = "2.8.1"
# Fault injection for tests: seconds the writer waits before each file (a save still running when a job is killed).
DELAY_ENV = "PIPELINE_CHECKPOINT_WRITE_DELAY_S"

_writer: "Writer | None" = None


class Writer(threading.Thread):
    """Runs queued tasks one after the other; after the first failure it runs nothing more."""

    def __init__(self):
        super().__init__(name="checkpoint-writer", daemon=True)
        self.tasks: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.start()

    def submit(self, fn, *args) -> None:
        self.tasks.put((fn, args))

    def run(self) -> None:
        while True:
            fn, args = self.tasks.get()
            try:
                if self.error is None:
                    fn(*args)
            except BaseException as exc:  # noqa: BLE001  (reported to the training thread by check/drain)
                self.error = exc
                print(f"checkpoint writer: {exc.__class__.__name__}: {exc}", file=sys.stderr, flush=True)
            finally:
                self.tasks.task_done()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"an asynchronous checkpoint write failed: {self.error.__class__.__name__}: "
                               f"{self.error}") from self.error

    def drain(self) -> None:
        """Wait until everything queued has run (files written and fsynced, markers written)."""
        self.tasks.join()
        self.check()


def enabled(training, layout) -> bool:
    """training.async_checkpoint (the training section's) applies to unified checkpoints (semi_auto saves its own
    way, synchronously)."""
    return training.async_checkpoint and layout.mode != "semi_auto"


def writer() -> Writer:
    global _writer
    if _writer is None:
        _writer = Writer()
    return _writer


def _write(save_file, state_dict: dict, path: str) -> None:
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    if delay:
        time.sleep(delay)
    save_file(state_dict, path, metadata={"format": "np"})
    fsync_path(path)


def apply() -> None:
    """Route PaddleNLP's asynchronous unified-checkpoint writes to this rank's writer thread."""
    found = version("paddlenlp")
    if found != SUPPORTED_PADDLENLP:
        raise RuntimeError(f"training/checkpoint/async_write.py replaces a function of PaddleNLP {SUPPORTED_PADDLENLP}, "
                           f"found {found}: check file_save_async_or_sync there, or set training.async_checkpoint="
                           f"false")
    import paddle
    from paddlenlp.trainer.plugins import unified_checkpoint as uc

    original = uc.file_save_async_or_sync
    if getattr(original, "_pipeline_async", False):
        return

    def file_save_async_or_sync(state_dict, path, safe_serialization, is_sync=True):
        # (`is_sync` is ignored: on one process PaddleNLP 2.8.1 always passes True, save_single_card_checkpoint
        # does not read async_save; every caller is a checkpoint save of the training loop)
        if not safe_serialization:
            return original(state_dict, path, safe_serialization, is_sync=True)
        for key in list(state_dict):  # the snapshot: host copies, so the next optimizer step cannot change them
            if isinstance(state_dict[key], paddle.Tensor):
                state_dict[key] = state_dict.pop(key).cpu().numpy()
        writer().submit(_write, uc.safe_save_file, state_dict, path)

    file_save_async_or_sync._pipeline_async = True
    uc.file_save_async_or_sync = file_save_async_or_sync
