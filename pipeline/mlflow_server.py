"""`make mlflow-server` / `make mlflow-stop`: a real MLflow tracking server over the local store, on loopback.

Settings come from mlflow/server.env. The server runs in its own process group (its gunicorn/uvicorn workers are
children), so stopping signals the whole group.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline import REPO_ROOT
from pipeline.config import ConfigError
from pipeline.processes import group_alive, port_in_use

SETTINGS = REPO_ROOT / "mlflow" / "server.env"
STATE_DIR = REPO_ROOT / "mlflow" / "server"


def settings() -> dict[str, str]:
    values = {}
    for line in SETTINGS.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def start(host: str, port: int, backend_store: Path, artifacts: Path, state_dir: Path, workers: int = 1,
          timeout_s: float = 90) -> dict:
    import requests

    state_file = state_dir / "server.json"
    if state_file.exists() and group_alive(json.loads(state_file.read_text())["pid"]):
        raise ConfigError(f"an MLflow server is already running ({state_file}); `make mlflow-stop` first")
    if port_in_use(port):
        raise ConfigError(f"port {port} is in use; change PORT in mlflow/server.env")
    state_dir.mkdir(parents=True, exist_ok=True)
    backend_store.parent.mkdir(parents=True, exist_ok=True)
    artifacts.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")  # no extra job-runner processes
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{backend_store}",
           "--artifacts-destination", str(artifacts), "--host", host, "--port", str(port), "--workers", str(workers)]
    with open(state_dir / "server.log", "ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=state_dir)
    url = f"http://{host}:{port}"
    state = {"pid": proc.pid, "url": url}
    state_file.write_text(json.dumps(state))
    deadline = time.time() + timeout_s
    while True:
        try:
            if requests.get(url + "/health", timeout=2).ok:
                return state
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.time() > deadline:
            stop(state_dir)
            tail = (state_dir / "server.log").read_text(errors="replace").splitlines()[-20:]
            raise ConfigError("the MLflow server did not become healthy; last log lines:\n" + "\n".join(tail))
        time.sleep(0.5)


def stop(state_dir: Path) -> bool:
    state_file = state_dir / "server.json"
    if not state_file.exists():
        return False
    pgid = json.loads(state_file.read_text())["pid"]
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        if group_alive(pgid):
            os.killpg(pgid, sig)
            deadline = time.time() + wait_s
            while group_alive(pgid) and time.time() < deadline:
                time.sleep(0.2)
    state_file.unlink(missing_ok=True)
    return True


def main(verb: str) -> int:
    s = settings()
    if verb == "mlflow-stop":
        print("stopped" if stop(STATE_DIR) else "no MLflow server was running")
        return 0
    state = start(s["HOST"], int(s["PORT"]), REPO_ROOT / s["BACKEND_STORE"], REPO_ROOT / s["ARTIFACTS_DESTINATION"],
                  STATE_DIR, int(s.get("WORKERS", "1")))
    print(f"MLflow tracking server: {state['url']} (pid {state['pid']}); use it with\n"
          f"  export MLFLOW_TRACKING_URI={state['url']}")
    return 0
