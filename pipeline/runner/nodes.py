"""Multi-node runs share one run directory, on storage every node mounts (as on every cluster).

Node 0 creates and prepares the run directory (config, tokenizer, data) and opens the MLflow run; it decides where
the run resumes from, then writes `launch.json` into the run directory. Every other node waits for that file -- for
this launch: `$PIPELINE_LAUNCH_ID`, else `$MASTER`, must match -- checks that its own config is node 0's, and
starts its ranks with the resume point node 0 chose. All ranks write their parts of a checkpoint into the same
`checkpoints/checkpoint-<step>/`, which rank 0 marks complete only after a barrier over every rank of every node
(training/callbacks.py). Each node's launcher logs under `logs/node<k>/`.

Without shared storage the file never appears on the other nodes: they stop after `parallel.node_wait_s` with a
message naming the path. (A per-node mode was dropped: checkpoints spread over several disks cannot be resumed.)
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path

from core.errors import ConfigError
from core.files import atomic_write

LAUNCH_FILE = "launch.json"


def node_rank() -> int:
    return int(os.environ.get("NODE_RANK", "0") or 0)


def launch_id() -> str:
    """What identifies one launch of all the nodes (a requeued job is a new launch)."""
    return os.environ.get("PIPELINE_LAUNCH_ID") or os.environ.get("MASTER", "")


def config_digest(config_yaml: str) -> str:
    return hashlib.sha256(config_yaml.encode()).hexdigest()[:16]


def log_dir(run_dir: Path, nnodes: int) -> Path:
    """Where this node's launcher writes `workerlog.<local rank>` (node subfolders when several nodes share it)."""
    return run_dir / "logs" / f"node{node_rank()}" if nnodes > 1 else run_dir / "logs"


def announce(run_dir: Path, config_yaml: str, resume_from: Path | None, pending: Path | None) -> None:
    """Node 0: the run directory is ready; this is where the ranks start from."""
    info = {"launch_id": launch_id(), "config_sha": config_digest(config_yaml),
            "resume_from": str(resume_from) if resume_from else "", "pending_config": str(pending) if pending else "",
            "host": socket.gethostname(), "written_at": time.time()}
    atomic_write(run_dir / LAUNCH_FILE, json.dumps(info, indent=2))


def withdraw(run_dir: Path) -> None:
    """Node 0, when its ranks are done: a later launch must not read this one's file."""
    (run_dir / LAUNCH_FILE).unlink(missing_ok=True)


def wait_for_launch(run_dir: Path, config_yaml: str, wait_s: float, poll_s: float = 0.5) -> dict:
    """Nodes > 0: node 0's announcement of this launch (bounded wait), checked against this node's config."""
    deadline = time.time() + wait_s
    print(f"node {node_rank()}: waiting for node 0 to prepare {run_dir} (launch {launch_id()!r}, up to "
          f"{wait_s:g}s)", flush=True)
    while True:
        try:
            info = json.loads((run_dir / LAUNCH_FILE).read_text())
        except (OSError, ValueError):
            info = None
        if info and info.get("launch_id") == launch_id():
            break
        if time.time() > deadline:
            raise ConfigError(
                f"node {node_rank()}: node 0 did not prepare {run_dir / LAUNCH_FILE} for this launch within "
                f"parallel.node_wait_s={wait_s:g}s; every node must see the same training.runs_dir on shared "
                f"storage (is {run_dir.parent} shared with node 0?), and node 0 must have started without an error")
        time.sleep(poll_s)
    if info["config_sha"] != config_digest(config_yaml):
        raise ConfigError(f"node {node_rank()}: this node's config differs from node 0's ({run_dir / 'config.yaml'}"
                          f"); run the same command, CONFIG and ARGS on every node")
    return info
