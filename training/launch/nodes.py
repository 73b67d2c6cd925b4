"""Multi-node runs share one run directory, on storage every node mounts (as on every cluster).

Node 0 creates and prepares the run directory (config, tokenizer, data) and opens the MLflow run; it decides where
the run resumes from, then writes `launch.json` into the run directory. Every other node waits for that file -- for
this launch: `$PIPELINE_LAUNCH_ID`, else `$MASTER`, must match -- checks that its own config is node 0's, and
starts its ranks with the resume point node 0 chose. All ranks write their parts of a checkpoint into the same
`checkpoints/checkpoint-<step>/`, which rank 0 marks complete only after a barrier over every rank of every node
(training/checkpoint/manager.py). Each node's launcher logs under `logs/node<k>/`.

Without shared storage the file never appears on the other nodes: they stop after `parallel.node_wait_s` with a
message naming the path.

Nodes that share no filesystem (`storage.shared_filesystem=false`) meet in the object store instead: node 0 puts the
announcement at `<storage.uri>/runs/<run>/launch.json` (and the run's MLflow id at `run.json`, so that a node 0
requeued onto an empty disk finds its run); every node keeps its own run directory on local disk, made from the
announced config, and each node's first rank uploads its node's part of every checkpoint
(training/checkpoint/upload.py). A checkpoint resumes from the store once every node's part is there.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path

import yaml

from core.errors import ConfigError
from core.files import atomic_write
from core.storage import Store
from training.checkpoint.in_store import run_prefix

LAUNCH_FILE = "launch.json"
RUN_RECORD = "run.json"  # (in the store: the MLflow run of a run whose nodes share no filesystem)


def node_rank() -> int:
    return int(os.environ.get("NODE_RANK", "0") or 0)


def launch_id() -> str:
    """What identifies one launch of all the nodes (a requeued job is a new launch)."""
    return os.environ.get("PIPELINE_LAUNCH_ID") or os.environ.get("MASTER", "")


# Settings that name places on a node's own disk: they may differ between nodes that share no filesystem.
NODE_LOCAL = {"training": ("runs_dir",), "data": ("cache_dir", "local_dir")}


def config_digest(config_yaml: str) -> str:
    """What every node's config must agree on: all of it but the places on a node's own disk."""
    return hashlib.sha256(json.dumps(_agreed(config_yaml), sort_keys=True).encode()).hexdigest()[:16]


def log_dir(run_dir: Path, nnodes: int) -> Path:
    """Where this node's launcher writes `workerlog.<local rank>` (node subfolders when several nodes share it)."""
    return run_dir / "logs" / f"node{node_rank()}" if nnodes > 1 else run_dir / "logs"


def meeting_store(storage, nnodes: int):
    """The object store where the nodes meet (the storage section's), when they share no filesystem; None when they
    share one."""
    if storage.shared_filesystem or nnodes <= 1:
        return None

    return Store.of(storage)


def _store_key(store, run_dir: Path, name: str) -> str:
    return f"{run_prefix(store, run_dir.name)}/{name}"


def announce(run_dir: Path, config_yaml: str, resume_from: Path | None, pending: Path | None, store=None,
             run_id: str = "") -> None:
    """Node 0: the run directory is ready; this is where the ranks start from (in the run directory, or in the
    store when the nodes share no filesystem)."""
    info = {"launch_id": launch_id(), "config_sha": config_digest(config_yaml), "config": config_yaml,
            "resume_from": str(resume_from) if resume_from else "", "pending_config": str(pending) if pending else "",
            "resume_checkpoint": resume_from.name if resume_from else "",
            "host": socket.gethostname(), "written_at": time.time()}
    atomic_write(run_dir / LAUNCH_FILE, json.dumps(info, indent=2))
    if store is not None:
        store.ensure_bucket()
        store.put(_store_key(store, run_dir, RUN_RECORD), json.dumps({"run_id": run_id}).encode())
        store.put(_store_key(store, run_dir, LAUNCH_FILE), json.dumps(info, indent=2).encode())


def recorded_run_id(store, run_dir: Path) -> str:
    """The MLflow run of the run named as `run_dir`, as node 0 recorded it in the store ("" if none)."""
    data = store.read(_store_key(store, run_dir, RUN_RECORD))
    return json.loads(data)["run_id"] if data else ""


def withdraw(run_dir: Path, store=None) -> None:
    """Node 0, when its ranks are done: a later launch must not read this one's file."""
    (run_dir / LAUNCH_FILE).unlink(missing_ok=True)
    if store is not None:
        store.delete([_store_key(store, run_dir, LAUNCH_FILE)])


def wait_for_launch(run_dir: Path, config_yaml: str, wait_s: float, poll_s: float = 0.5, store=None) -> dict:
    """Nodes > 0: node 0's announcement of this launch (bounded wait), checked against this node's config."""
    deadline = time.time() + wait_s
    where = f"s3://{store.bucket}/{_store_key(store, run_dir, LAUNCH_FILE)}" if store else str(run_dir / LAUNCH_FILE)
    print(f"node {node_rank()}: waiting for node 0 to prepare {run_dir if store is None else where} (launch "
          f"{launch_id()!r}, up to {wait_s:g}s)", flush=True)
    while True:
        try:
            info = json.loads(store.read(_store_key(store, run_dir, LAUNCH_FILE)) or "null") if store else \
                json.loads((run_dir / LAUNCH_FILE).read_text())
        except Exception:  # noqa: BLE001  (not there yet, half-written, or the store unreachable: keep waiting)
            info = None
        if info and info.get("launch_id") == launch_id():
            break
        if time.time() > deadline:
            raise ConfigError(
                f"node {node_rank()}: node 0 did not prepare {where} for this launch within "
                f"parallel.node_wait_s={wait_s:g}s; " + (
                    f"every node must see the same training.runs_dir on shared storage (is {run_dir.parent} shared "
                    "with node 0?)" if store is None else "every node must use the same storage.uri and "
                    "training.run_name") + ", and node 0 must have started without an error")
        time.sleep(poll_s)
    if info["config_sha"] != config_digest(config_yaml):
        differ = _differing(_agreed(info.get("config", "")), _agreed(config_yaml)) if info.get("config") else []
        raise ConfigError(f"node {node_rank()}: this node's config differs from node 0's ({run_dir / 'config.yaml'}"
                          + (f": {', '.join(differ)}" if differ else "") +
                          "); run the same command, CONFIG and ARGS on every node")
    return info


def _agreed(config_yaml: str) -> dict:
    """The settings every node must agree on: all but the places on a node's own disk."""
    values = yaml.safe_load(config_yaml)
    for section, keys in NODE_LOCAL.items():
        for key in keys:
            values.get(section, {}).pop(key, None)
    return values


def _differing(theirs: dict, ours: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ, as `key=<node 0's> (here <ours>)`."""
    out = []
    for key in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(key), ours.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differing(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}={a!r} on node 0 (here {b!r})")
    return out
