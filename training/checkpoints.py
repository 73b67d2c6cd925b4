"""Which checkpoints of a run are complete, and which is the latest.

PaddleNLP's Trainer writes `checkpoint-<step>/` in place, from every rank. A checkpoint only counts once all ranks
have finished writing it: rank 0 then writes `checkpoint_complete.json` inside it (after a barrier) and updates the
run's `checkpoints/latest` file by an atomic rename. Resume and export read only complete checkpoints.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

COMPLETE_MARKER = "checkpoint_complete.json"
# Written in the run directory by rank 0 when a signal stopped training early (step, signal).
STOPPED_MARKER = "stopped.json"
LATEST_FILE = "latest"
_STEP = re.compile(r"^checkpoint-(\d+)$")


def checkpoints_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / "checkpoints"


def mark_complete(checkpoint: Path, info: dict) -> None:
    _atomic_write(checkpoint / COMPLETE_MARKER, json.dumps(info, indent=2))
    _atomic_write(checkpoint.parent / LATEST_FILE, checkpoint.name + "\n")


def complete_checkpoints(run_dir: Path | str) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    root = checkpoints_dir(run_dir)
    found = []
    if root.is_dir():
        for child in root.iterdir():
            match = _STEP.match(child.name)
            if match and (child / COMPLETE_MARKER).is_file():
                found.append((int(match.group(1)), child))
    return sorted(found)


def latest_complete(run_dir: Path | str) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1][1] if done else None


def checkpoint_info(checkpoint: Path) -> dict:
    return json.loads((checkpoint / COMPLETE_MARKER).read_text())


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
