"""The start/stop controller of the server process, run in the `make serve` / `make stop` process (pipeline/serve.py,
pipeline/stop.py): starts serving/server/main.py for an export directory in the background and stops it.

The server runs in its own process group (setsid) with its working directory in a serving state directory
(`runs/serving/` by default), where Paddle Serving writes PipelineServingLogs/ and ProcessInfo.json, next to our
server.log, the rendered config.yml, server.json (pid, ports, URLs, model) and worker.json (the generation worker:
pid, load time, memory, restarts). Stop = SIGTERM to the server, which drains and exits; then the whole group is
interrupted and killed if anything is left (signalling only the main pid could orphan the Go HTTP gateway, which
keeps the port open).
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
from core.processes import group_alive, log_tail, port_in_use, proc_stat, start_group, stop_group, wait_ready
from core.workarounds.paddle_serving import COMPAT_DIR
from serving.client.client import GenerationClient
from serving.server.sizes import render_config
from serving.state import clear_state, read_state, register, unregister, write_state


def prepare(config: Config, model_dir: Path, state_dir: Path, follow: str = "") -> tuple[list[str], dict, dict]:
    """Check the model and the ports, write the state directory's files: (command, environment, state). `follow`: a
    models:/ reference the server keeps following (serving/server/follow.py)."""
    model_dir = model_dir.resolve()
    exportdir.read_meta(model_dir)  # a clear error when MODEL is not an export directory
    state = read_state(state_dir)
    if state and group_alive(state["pid"]):
        raise ConfigError(f"a server is already running from {state_dir} (pid {state['pid']}); `make stop` first")
    s = config.serving
    for key in ("http_port", "rpc_port", "api_port", "metrics_port"):
        if port_in_use(getattr(s, key)):
            raise ConfigError(f"port {getattr(s, key)} is already in use; set serving.{key}")
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "worker.json").unlink(missing_ok=True)
    (state_dir / "config.yml").write_text(yaml.safe_dump(render_config(config)))
    (state_dir / "service.yaml").write_text(config.to_yaml())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(COMPAT_DIR)]), SERVING_HOME=str(state_dir),
               SERVING_LOG_PATH=str(state_dir), GLOG_minloglevel="2", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "serving.server.main", "--config", str(state_dir / "config.yml"),
           "--service-config", str(state_dir / "service.yaml"), "--model", str(model_dir), "--state-dir",
           str(state_dir), *(["--follow", follow] if follow else [])]
    api = f"http://127.0.0.1:{s.api_port}"
    state = {"pid": os.getpid(), "http_port": s.http_port, "rpc_port": s.rpc_port, "api_port": s.api_port,
             "metrics_port": s.metrics_port, "service": s.service_name, "model_dir": str(model_dir),
             "http_url": f"http://127.0.0.1:{s.http_port}/{s.service_name}/prediction",
             "rpc_address": f"127.0.0.1:{s.rpc_port}", "api_url": api, "openai_base_url": f"{api}/v1",
             "metrics_url": f"http://127.0.0.1:{s.metrics_port}/metrics", "started_at": time.time(),
             "generation": s.generation, "scheduler": s.scheduler, "drain_grace_s": s.drain_grace_s,
             "follows": follow}
    return cmd, env, state


def start(config: Config, model_dir: Path, state_dir: Path, follow: str = "", owner: str = "") -> dict:
    """Start the server in its own process group and return once it is ready (/health/ready: a worker is loaded and
    answered a tiny generation; Paddle Serving's HTTP answers too). `owner` (the bench): the state directory is
    listed for `make stop` until it is stopped (serving/state.py register)."""
    cmd, env, state = prepare(config, model_dir, state_dir, follow)
    proc = start_group(cmd, state_dir / "server.log", state_dir, env)
    state["pid"] = proc.pid
    write_state(state_dir, state)
    if owner:
        register(state_dir, owner)
    s = config.serving
    outcome = wait_ready(proc, lambda: _ready(state["api_url"]) and _answers(state), s.start_timeout_s)
    if outcome == "exited":
        clear_state(state_dir)
        raise ConfigError("the server exited during start-up; last lines of server.log:\n"
                          + log_tail(state_dir / "server.log", 30))
    if outcome == "timeout":
        stop(state_dir)
        raise ConfigError(f"the server was not ready within {s.start_timeout_s}s; see {state_dir / 'server.log'}")
    state["ready_after_s"] = round(time.time() - state["started_at"], 2)
    write_state(state_dir, state)
    return state


def run_foreground(config: Config, model_dir: Path, state_dir: Path, follow: str = "") -> None:
    """The server as this very process (a container's main process: signals reach it directly; its exit code is
    the server's). Logs go to stdout/stderr."""
    cmd, env, state = prepare(config, model_dir, state_dir, follow)
    write_state(state_dir, state)  # (this pid: exec keeps it)
    os.chdir(state_dir)
    os.execvpe(cmd[0], cmd, env)


def _ready(api_url: str) -> bool:
    import requests

    return requests.get(f"{api_url}/health/ready", timeout=2).status_code == 200


def _answers(state: dict) -> bool:
    """Paddle Serving's own HTTP path is up too (its gateway starts after the gRPC server)."""
    return GenerationClient(state["http_url"], timeout=10).generate("你好", max_new_tokens=1) is not None


def running(state_dir: Path) -> dict | None:
    """The state of a server that still runs from `state_dir`, else None."""
    state = read_state(state_dir)
    return state if state and group_alive(state["pid"]) else None


def stop(state_dir: Path, grace_s: float | None = None) -> bool:
    """SIGTERM to the server: it drains (requests in flight finish, up to serving.drain_grace_s) and exits; whatever
    of its process group is left after that is interrupted, then killed. False if nothing was running."""
    state = read_state(state_dir)
    if not state:
        return False
    grace_s = state.get("drain_grace_s", 15.0) if grace_s is None else grace_s
    if group_alive(state["pid"]):
        try:
            os.kill(state["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.time() + grace_s + 5
        while _alive(state["pid"]) and time.time() < deadline:
            time.sleep(0.1)
    stop_group(state["pid"], ((signal.SIGINT, 5.0), (signal.SIGKILL, 10.0)))
    clear_state(state_dir)
    unregister(state_dir)
    for key in ("http_port", "rpc_port", "api_port", "metrics_port"):
        deadline = time.time() + 10
        while state.get(key) and port_in_use(state[key]) and time.time() < deadline:
            time.sleep(0.2)
    return True


def _alive(pid: int) -> bool:
    """The process lives and is not a zombie (exited, not yet reaped by a parent that is not us)."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"
