"""`make serve` / `make stop`: run the Paddle Serving Pipeline for an export directory in the background.

The server runs in its own process group (setsid) with its working directory in a serving state directory
(`runs/serving/` by default), where Paddle Serving writes PipelineServingLogs/ and ProcessInfo.json, next to our
server.log, the rendered config.yml and server.json (pid, ports, model). Stop = SIGINT to the whole group: signalling
only the main pid would orphan the Go HTTP gateway, which keeps the port open.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from pipeline import REPO_ROOT
from pipeline.config import Config, ConfigError
from pipeline.processes import group_alive, port_in_use

STATE_FILE = "server.json"


def default_state_dir(config: Config) -> Path:
    return (REPO_ROOT / config.training.runs_dir / "serving").resolve()


def read_state(state_dir: Path) -> dict | None:
    path = state_dir / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def start(config: Config, model_dir: Path, state_dir: Path) -> dict:
    from serving.client import GenerationClient, ServingError
    from serving.service import render_config
    from training.export import fetch_name

    model_dir = model_dir.resolve()
    if not (model_dir / "export.json").is_file():
        raise ConfigError(f"MODEL={model_dir} is not an export directory (no export.json); run `make export`")
    state = read_state(state_dir)
    if state and group_alive(state["pid"]):
        raise ConfigError(f"a server is already running from {state_dir} (pid {state['pid']}); `make stop` first")
    s = config.serving
    for port in (s.http_port, s.rpc_port):
        if port_in_use(port):
            raise ConfigError(f"port {port} is already in use; set serving.http_port / serving.rpc_port")
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "config.yml").write_text(yaml.safe_dump(render_config(config, model_dir, fetch_name(model_dir))))
    (state_dir / "service.yaml").write_text(config.to_yaml())
    env = dict(os.environ)
    from serving import COMPAT_DIR

    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(COMPAT_DIR)])
    env["SERVING_HOME"] = str(state_dir)
    env["SERVING_LOG_PATH"] = str(state_dir)
    env["GLOG_minloglevel"] = "2"
    env["PYTHONUNBUFFERED"] = "1"
    with open(state_dir / "server.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "serving.service", "--config", str(state_dir / "config.yml"),
             "--service-config", str(state_dir / "service.yaml"), "--model", str(model_dir)],
            cwd=state_dir, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
    state = {"pid": proc.pid, "http_port": s.http_port, "rpc_port": s.rpc_port, "service": s.service_name,
             "model_dir": str(model_dir), "http_url": f"http://127.0.0.1:{s.http_port}/{s.service_name}/prediction",
             "rpc_address": f"127.0.0.1:{s.rpc_port}", "started_at": time.time()}
    (state_dir / STATE_FILE).write_text(json.dumps(state, indent=2))
    client = GenerationClient(state["http_url"], state["rpc_address"], timeout=10)
    deadline = time.time() + s.start_timeout_s
    while True:  # ready = a real prediction succeeds
        if proc.poll() is not None:
            tail = (state_dir / "server.log").read_text(errors="replace").splitlines()[-30:]
            (state_dir / STATE_FILE).unlink(missing_ok=True)
            raise ConfigError("the server exited during start-up; last lines of server.log:\n" + "\n".join(tail))
        try:
            client.generate("你好", max_new_tokens=1)
            break
        except (ServingError, OSError, ValueError):
            pass
        except Exception:  # noqa: BLE001  (requests' connection errors while the gateway comes up)
            pass
        if time.time() > deadline:
            stop(state_dir)
            raise ConfigError(f"the server did not answer a prediction within {s.start_timeout_s}s; see "
                              f"{state_dir / 'server.log'}")
        time.sleep(0.5)
    state["ready_after_s"] = round(time.time() - state["started_at"], 2)
    (state_dir / STATE_FILE).write_text(json.dumps(state, indent=2))
    return state


def stop(state_dir: Path, grace_s: float = 15.0) -> bool:
    """SIGINT to the server's process group, SIGKILL after the grace period. False if nothing was running."""
    state = read_state(state_dir)
    if not state:
        return False
    pgid = state["pid"]
    if group_alive(pgid):
        os.killpg(pgid, signal.SIGINT)
        deadline = time.time() + grace_s
        while group_alive(pgid) and time.time() < deadline:
            time.sleep(0.2)
        if group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
            while group_alive(pgid):
                time.sleep(0.1)
    for name in (STATE_FILE, "ProcessInfo.json"):
        (state_dir / name).unlink(missing_ok=True)
    for port in (state["http_port"], state["rpc_port"]):
        deadline = time.time() + 10
        while port_in_use(port) and time.time() < deadline:
            time.sleep(0.2)
    return True
