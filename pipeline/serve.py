"""`make serve` / `make stop` / `make smoke`: the endpoint verbs over serving/ (server start/stop, smoke checks)."""
from __future__ import annotations

from pipeline import models, tracking
from pipeline.config import Config, ConfigError
from serving import server
from serving.smoke import run_smoke
from serving.state import default_state_dir, read_state


def serve(config: Config, model: str) -> int:
    """MODEL: an export directory or models:/<name>/<version|latest> / models:/<name>@<alias> (pipeline/models.py)."""
    state_dir = default_state_dir(config)
    state = server.start(config, models.resolve(config, model), state_dir)
    print(f"serving {state['model_dir']} (ready in {state['ready_after_s']}s, pid {state['pid']})\n"
          f"HTTP: {state['http_url']}\ngRPC: {state['rpc_address']}\nlogs: {state_dir}")
    return 0


def stop(config: Config) -> int:
    print("stopped" if server.stop(default_state_dir(config)) else "no server was running")
    return 0


def smoke(config: Config) -> int:
    state = read_state(default_state_dir(config))
    if not state:
        raise ConfigError("no running server; start it with `make serve`")
    failures = run_smoke(state, tracking.client(tracking.tracking_uri(config)))
    print("SMOKE", "PASS" if not failures else f"FAIL ({len(failures)} checks)")
    return 1 if failures else 0
