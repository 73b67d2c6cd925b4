"""Checkpoints in the object store (`storage.uri`): where they go, which are complete, fetching one, retention there,
and the record of those that never arrived. The S3 client is core/storage.py's; the upload thread is upload.py.

Layout (docs/storage.md):
    <prefix>/runs/<run name>/checkpoints/checkpoint-<step>/<the checkpoint's files>
                                                           .parts/node-<k>.json       (nodes without a shared disk)
                                                           checkpoint_complete.json   (last, If-None-Match)
    <prefix>/runs/<run name>/writer.json                  (the one writer's lease: lease.py)
    <prefix>/runs/<run name>/launch.json, run.json        (nodes without a shared disk: where they meet)
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from core.storage import Store, retrying
from training.checkpoint.local import COMPLETE_MARKER, mark_complete, to_prune
from core.files import atomic_write

PARTS_DIR = ".parts"  # (one record per node whose part of the checkpoint is uploaded)
NOT_UPLOADED = "store_missing.json"  # (run directory: what the end of the run found missing in the store)


def run_prefix(store: Store, run_name: str) -> str:
    return store.key("runs", run_name)


def checkpoints_prefix(store: Store, run_name: str) -> str:
    return store.key("runs", run_name, "checkpoints")


def part_key(store: Store, run_name: str, checkpoint: str, node: int) -> str:
    """A node's record that its part of a checkpoint is in the store (runs whose nodes share no filesystem)."""
    return f"{checkpoints_prefix(store, run_name)}/{checkpoint}/{PARTS_DIR}/node-{node}.json"


def marker_key(store: Store, run_name: str, step: int) -> str:
    return f"{checkpoints_prefix(store, run_name)}/checkpoint-{step}/{COMPLETE_MARKER}"


def checkpoint_keys(store: Store, run_name: str) -> dict[int, list[str]]:
    """step -> the keys under checkpoint-<step>/ of the run (complete or not), from one listing."""
    prefix = checkpoints_prefix(store, run_name)
    found: dict[int, list[str]] = {}
    for key in store.keys(prefix):
        name = key[len(prefix) + 1:].split("/")[0]
        if name.startswith("checkpoint-") and name[11:].isdigit():
            found.setdefault(int(name[11:]), []).append(key)
    return found


def complete_steps(store: Store, run_name: str, listed: dict[int, list[str]] | None = None) -> dict[int, dict]:
    """step -> the completion record of every checkpoint of the run that is complete in the store (`listed`: the
    run's checkpoint_keys, when the caller has them)."""
    listed = checkpoint_keys(store, run_name) if listed is None else listed
    return {step: json.loads(store.read(marker_key(store, run_name, step)) or b"{}")
            for step, keys in listed.items() if marker_key(store, run_name, step) in keys}


def complete_steps_retrying(store: Store, run_name: str) -> dict[int, dict]:
    """complete_steps, riding a store outage of up to the store's retry_s; StoreError in one line after it."""
    return retrying(lambda: complete_steps(store, run_name), f"listing the checkpoints of {run_name}", store)


def mark_complete_in_store(store: Store, run_name: str, step: int, info: dict) -> bool:
    """The completion record, written last and once (If-None-Match): False if it was there already."""
    return store.put_if_absent(marker_key(store, run_name, step), json.dumps(info).encode())


def retain(store: Store, run_name: str, keep: int, metric: str) -> list[int]:
    """Retention in the store (training.keep_checkpoints): local.to_prune's choice over the complete checkpoints,
    and the parts of checkpoints older than the newest complete one that never completed. A removed checkpoint
    loses its marker first: never a partial one that counts as complete. The steps removed."""
    if keep <= 0:
        return []
    listed = checkpoint_keys(store, run_name)
    steps = complete_steps(store, run_name, listed)
    doomed = to_prune(list(steps.items()), keep, metric)
    never = {s for s in set(listed) - set(steps) if steps and s < max(steps)}
    for step in sorted(doomed | never):
        marker = marker_key(store, run_name, step)
        store.delete([marker])
        store.delete([k for k in listed[step] if k != marker])
    return sorted(doomed | never)


def fetch(store: Store, run_dir: Path, step: int, record: dict) -> tuple[Path, int, float]:
    """Checkpoint `step`, complete in the store, into the run directory: the files this disk lacks (all of them
    unless this disk holds a complete part of it), marked complete with the store's record. A store outage is
    ridden for the store's retry_s; after it, StoreError in one line and nothing marked. (path, bytes, seconds)"""
    began = time.time()
    checkpoint = run_dir / "checkpoints" / f"checkpoint-{step}"
    if not (checkpoint / COMPLETE_MARKER).is_file():
        shutil.rmtree(checkpoint, ignore_errors=True)  # (a part cut short here: taken whole from the store)
    files = retrying(lambda: store.download(
        f"{checkpoints_prefix(store, run_dir.name)}/{checkpoint.name}", checkpoint,
        lambda relative: relative.split("/")[0] in (PARTS_DIR, COMPLETE_MARKER) or (checkpoint / relative).is_file()),
        f"fetching {checkpoint.name}", store)
    size = sum(f.stat().st_size for f in files)
    mark_complete(checkpoint, record)  # (its record as the store has it, and `latest`)
    return checkpoint, size, time.time() - began


def fetch_latest(store: Store, run_dir: Path) -> tuple[Path, int, float] | None:
    """The run's latest checkpoint complete in the store (every node's part there), made whole on this disk; None
    if the store has none yet."""
    steps = complete_steps_retrying(store, run_dir.name)
    if not steps:
        return None
    return fetch(store, run_dir, max(steps), steps[max(steps)])


def fetch_step(store: Store, run_dir: Path, step: int) -> Path | None:
    """Checkpoint `step` if it is complete in the store, made whole on this disk; None if it is not."""
    record = complete_steps_retrying(store, run_dir.name).get(step)
    return None if record is None else fetch(store, run_dir, step, record)[0]


def record_missing(run_dir: Path, missing: list[str], reason: str) -> None:
    """Rank 0 at the end of a run: the checkpoints that did not reach the store (the launcher reads it: `missing`)."""
    atomic_write(run_dir / NOT_UPLOADED, json.dumps({"missing": missing, "reason": reason}))


def missing(run_dir: Path) -> dict | None:
    """What the end of the last launch found missing in the store, or None (all there, or no store)."""
    try:
        return json.loads((run_dir / NOT_UPLOADED).read_text())
    except (OSError, ValueError):
        return None
