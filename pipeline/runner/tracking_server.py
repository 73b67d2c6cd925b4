"""A real MLflow tracking server over the local store, on loopback, started and stopped (`make mlflow-server`,
`make mlflow-stop`, and the tests' servers).

Settings come from mlflow/server.env. The server runs in its own process group (its gunicorn/uvicorn workers are
children), so stopping signals the whole group.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from core import REPO_ROOT
from core.config import ConfigError
from core.files import atomic_write
from core.processes import group_alive, log_tail, port_in_use, start_group, stop_recorded, wait_ready

SETTINGS = REPO_ROOT / "mlflow" / "server.env"
STATE_DIR = REPO_ROOT / "mlflow" / "server"


def settings() -> dict[str, str]:
    values = {}
    for line in SETTINGS.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def start(host: str, port: int, backend_store: Path, artifacts: Path | str, state_dir: Path, workers: int = 1,
          timeout_s: float = 90, store_env: dict | None = None) -> dict:
    """`artifacts`: a local directory, or s3://bucket/prefix with `store_env` (the object store's endpoint and
    credentials: the server writes the artifacts it proxies there, clients need no credentials of their own)."""
    import requests

    state_file = state_dir / "server.json"
    if state_file.exists() and group_alive(json.loads(state_file.read_text())["pid"]):
        raise ConfigError(f"an MLflow server is already running ({state_file}); `make mlflow-stop` first")
    if port_in_use(port):
        raise ConfigError(f"port {port} is in use; change PORT in mlflow/server.env")
    for directory in (state_dir, backend_store.parent, *([] if str(artifacts).startswith("s3://") else [artifacts])):
        Path(directory).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", **(store_env or {}))  # (no job runners)
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{backend_store}",
           "--artifacts-destination", str(artifacts), "--host", host, "--port", str(port), "--workers", str(workers)]
    proc = start_group(cmd, state_dir / "server.log", state_dir, env)
    url = f"http://{host}:{port}"
    state = {"pid": proc.pid, "url": url, "artifacts": str(artifacts)}
    atomic_write(state_file, json.dumps(state))  # (a reader never sees half of it)
    if wait_ready(proc, lambda: requests.get(url + "/health", timeout=2).ok, timeout_s) != "ready":
        stop(state_dir)
        raise ConfigError("the MLflow server did not become healthy; last log lines:\n"
                          + log_tail(state_dir / "server.log", 20))
    return state


def stop(state_dir: Path) -> bool:
    return stop_recorded(state_dir / "server.json")
