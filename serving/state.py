"""Where a running endpoint records itself: `<state dir>/server.json` (pid, ports, URLs, model) and `worker.json` (its
generation worker). Read by the server verbs, the client's command line and smoke."""
from __future__ import annotations

import json
from pathlib import Path
import hashlib

from core import REPO_ROOT
from core.files import atomic_write
from core.files import user_cache

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


def registry_dir() -> Path:
    """Where servers started on behalf of a tool (the bench) are listed, per user: `make stop` finds them there."""
    return user_cache("servers")


def register(state_dir: Path, owner: str) -> None:
    entry = registry_dir() / f"{hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:16]}.json"
    entry.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(entry, json.dumps({"state_dir": str(state_dir.resolve()), "owner": owner}))


def unregister(state_dir: Path) -> None:
    for entry, info in _entries():
        if info.get("state_dir") == str(state_dir.resolve()):
            entry.unlink(missing_ok=True)


def registered(owner: str) -> list[Path]:
    """The state directories of servers `owner` started and did not stop (they may have died since)."""
    return [Path(info["state_dir"]) for _, info in _entries() if info.get("owner") == owner]


def _entries() -> list[tuple[Path, dict]]:
    out = []
    for entry in sorted(registry_dir().glob("*.json")) if registry_dir().is_dir() else []:
        try:
            out.append((entry, json.loads(entry.read_text())))
        except (OSError, ValueError):
            continue
    return out
