"""`make serve` / `make stop`: run the Paddle Serving Pipeline for an export directory in the background.

The server runs in its own process group (setsid) with its working directory in a serving state directory
(`runs/serving/` by default), where Paddle Serving writes PipelineServingLogs/ and ProcessInfo.json, next to our
server.log, the rendered config.yml and server.json (pid, ports, model). Stop = SIGINT to the whole group: signalling
only the main pid would orphan the Go HTTP gateway, which keeps the port open.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import yaml

from core import REPO_ROOT, exportdir
from core.config import Config, ConfigError
from core.processes import group_alive, log_tail, port_in_use, start_group, stop_group, wait_ready
from core.workarounds.paddle_serving import COMPAT_DIR
from serving.client import GenerationClient
from serving.service import op_processes, render_config
from serving.state import clear_state, read_state, write_state


def start(config: Config, model_dir: Path, state_dir: Path) -> dict:
    model_dir = model_dir.resolve()
    exportdir.read_meta(model_dir)  # a clear error when MODEL is not an export directory
    state = read_state(state_dir)
    if state and group_alive(state["pid"]):
        raise ConfigError(f"a server is already running from {state_dir} (pid {state['pid']}); `make stop` first")
    s = config.serving
    for port in (s.http_port, s.rpc_port):
        if port_in_use(port):
            raise ConfigError(f"port {port} is already in use; set serving.http_port / serving.rpc_port")
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "config.yml").write_text(yaml.safe_dump(render_config(config)))
    (state_dir / "service.yaml").write_text(config.to_yaml())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(COMPAT_DIR)]), SERVING_HOME=str(state_dir),
               SERVING_LOG_PATH=str(state_dir), GLOG_minloglevel="2", PYTHONUNBUFFERED="1")
    proc = start_group([sys.executable, "-m", "serving.service", "--config", str(state_dir / "config.yml"),
                        "--service-config", str(state_dir / "service.yaml"), "--model", str(model_dir)],
                       state_dir / "server.log", state_dir, env)
    state = {"pid": proc.pid, "http_port": s.http_port, "rpc_port": s.rpc_port, "service": s.service_name,
             "model_dir": str(model_dir), "http_url": f"http://127.0.0.1:{s.http_port}/{s.service_name}/prediction",
             "rpc_address": f"127.0.0.1:{s.rpc_port}", "started_at": time.time(),
             "generation": s.generation, "op_processes": op_processes(s)}
    write_state(state_dir, state)
    client = GenerationClient(state["http_url"], state["rpc_address"], timeout=10)
    # ready = a real prediction succeeds
    outcome = wait_ready(proc, lambda: client.generate("你好", max_new_tokens=1) is not None, s.start_timeout_s)
    if outcome == "exited":
        clear_state(state_dir)
        raise ConfigError("the server exited during start-up; last lines of server.log:\n"
                          + log_tail(state_dir / "server.log", 30))
    if outcome == "timeout":
        stop(state_dir)
        raise ConfigError(f"the server did not answer a prediction within {s.start_timeout_s}s; see "
                          f"{state_dir / 'server.log'}")
    state["ready_after_s"] = round(time.time() - state["started_at"], 2)
    write_state(state_dir, state)
    return state


def stop(state_dir: Path, grace_s: float = 15.0) -> bool:
    """SIGINT to the server's process group, SIGKILL after the grace period. False if nothing was running."""
    state = read_state(state_dir)
    if not state:
        return False
    stop_group(state["pid"], ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)))
    clear_state(state_dir)
    for port in (state["http_port"], state["rpc_port"]):
        deadline = time.time() + 10
        while port_in_use(port) and time.time() < deadline:
            time.sleep(0.2)
    return True
