"""Where a running endpoint records itself: `<state dir>/server.json` (pid, ports, URLs, model) and `worker.json` (its
generation worker). Read by the server verbs, the client's command line and smoke."""
from __future__ import annotations

import json
from pathlib import Path

from core import REPO_ROOT
from core.files import atomic_write

STATE_FILE = "server.json"


def default_state_dir(config) -> Path:
    return (REPO_ROOT / config.training.runs_dir / "serving").resolve()


def read_state(state_dir: Path) -> dict | None:
    path = state_dir / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_state(state_dir: Path, state: dict) -> None:
    atomic_write(state_dir / STATE_FILE, json.dumps(state, indent=2))  # (`make stop` reads it: never half of it)


def clear_state(state_dir: Path) -> None:
    for name in (STATE_FILE, "ProcessInfo.json"):
        (state_dir / name).unlink(missing_ok=True)


WORKER_FILE = "worker.json"


def read_worker(state_dir: Path) -> dict:
    """The current generation worker (serving/engine/dispatch.py writes it each time one is ready): pid, load time, memory,
    restarts so far. {} before the first is ready."""
    try:
        return json.loads((Path(state_dir) / WORKER_FILE).read_text())
    except (OSError, ValueError):
        return {}
