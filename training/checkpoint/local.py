"""Checkpoints on local disk: which are complete, which is the latest, retention, and durability.

PaddleNLP's Trainer writes `checkpoint-<step>/` in place, from every rank (of every node: the run directory is
shared). A checkpoint only counts once all ranks have finished writing it and made it durable (fsync): rank 0 then
writes `checkpoint_complete.json` inside it (after a barrier) and updates the run's `checkpoints/latest` file by an
atomic rename. Resume and export read only complete checkpoints. Retention (`training.keep_checkpoints`) deletes
older checkpoints as new ones complete, never the newest ones nor the best by `export.metric`.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from core.files import atomic_write, fsync_path

COMPLETE_MARKER = "checkpoint_complete.json"  # (a complete checkpoint's record, on disk as in the store)

# Written in the run directory by rank 0 when a signal stopped training early (step, signal).
STOPPED_MARKER = "stopped.json"
LATEST_FILE = "latest"
# Left in a checkpoint by each rank once its files are durable (asynchronous saves; rank 0 waits for all of them).
DONE_MARKER_PREFIX = ".done-rank"
_STEP = re.compile(r"^checkpoint-(\d+)$")


def checkpoints_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / "checkpoints"


def mark_complete(checkpoint: Path, info: dict) -> None:
    atomic_write(checkpoint / COMPLETE_MARKER, json.dumps(info, indent=2))
    atomic_write(checkpoint.parent / LATEST_FILE, checkpoint.name + "\n")


def step_of(checkpoint: Path) -> int | None:
    match = _STEP.match(Path(checkpoint).name)
    return int(match.group(1)) if match else None


def to_prune(complete: list[tuple[int, dict]], keep: int, metric: str) -> set[int]:
    """Steps of the complete checkpoints that retention removes: all but the newest `keep` and the best by `metric`
    (lowest; the earliest of equals). `keep` 0 keeps everything. `complete` is (step, checkpoint info)."""
    if keep <= 0 or len(complete) <= keep:
        return set()
    steps = sorted(step for step, _ in complete)
    kept = set(steps[-keep:])
    rated = [(info[metric], step) for step, info in complete if isinstance(info.get(metric), (int, float))]
    if rated:
        kept.add(min(rated)[1])
    return set(steps) - kept


def prune(run_dir: Path | str, keep: int, metric: str, newest_complete: int, protect: set[str] = frozenset()) \
        -> list[Path]:
    """Apply retention after checkpoint `newest_complete` was marked complete (training.keep_checkpoints).

    Removes complete checkpoints `to_prune` picks, and incomplete ones older than `newest_complete` (left by a crash;
    a checkpoint newer than it may still be being written, so it is never touched). A removed checkpoint loses its
    complete marker first, so a removal cut short never leaves a half-deleted checkpoint that counts as complete."""
    if keep <= 0:
        return []
    complete = complete_checkpoints(run_dir)
    doomed = to_prune([(step, checkpoint_info(path)) for step, path in complete], keep, metric)
    removed = [path for step, path in complete if step in doomed and str(path.resolve()) not in protect]
    removed += [path for step, path in _incomplete(run_dir) if step < newest_complete]  # (protect: uploads running)
    for path in removed:
        (path / COMPLETE_MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return removed


def make_durable(checkpoint: Path) -> None:
    """fsync every file of a checkpoint and the directory itself: once a rank returns from this, what it wrote
    survives a crash of the machine (close() alone leaves it in the page cache). Cheap next to writing it."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        return
    for path in [*sorted(p for p in checkpoint.rglob("*") if p.is_file()), checkpoint, checkpoint.parent]:
        try:
            fsync_path(path)
        except FileNotFoundError:  # removed meanwhile (another rank's temporary file)
            continue


def complete_checkpoints(run_dir: Path | str) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    return [(step, path) for step, path in _checkpoint_dirs(run_dir) if (path / COMPLETE_MARKER).is_file()]


def _incomplete(run_dir: Path | str) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint directory without its complete marker, oldest first."""
    return [(step, path) for step, path in _checkpoint_dirs(run_dir) if not (path / COMPLETE_MARKER).is_file()]


def _checkpoint_dirs(run_dir: Path | str) -> list[tuple[int, Path]]:
    root = checkpoints_dir(run_dir)
    found = [(step_of(child), child) for child in (root.iterdir() if root.is_dir() else []) if child.is_dir()]
    return sorted((step, path) for step, path in found if step is not None)


def latest_complete(run_dir: Path | str) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1][1] if done else None


def remove_partial(run_dir: Path | str) -> list[Path]:
    """Remove the checkpoints newer than the latest complete one (left by a crash, a kill or a full disk mid-save).
    Only when no rank of the run is running: the launcher calls it before a resume and after a failure."""
    latest = latest_complete(run_dir)
    newest = step_of(latest) if latest else -1
    partial = [path for step, path in _incomplete(run_dir) if step > newest]
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def checkpoint_info(checkpoint: Path) -> dict:
    return json.loads((checkpoint / COMPLETE_MARKER).read_text())


