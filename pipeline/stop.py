"""`make stop`: drain the running endpoint (requests in flight finish) and stop its whole process group; also any
server a bench left running (`make bench` lists its servers until it stops them)."""
from __future__ import annotations

from core.config import Config
from serving import controller
from serving.state import default_state_dir, registered, unregister
from pipeline.runner.cli import config_argument, overrides_argument

HELP = "drain and stop the running endpoint (SIGTERM, then its whole process group)"


def arguments(p) -> None:
    config_argument(p)
    overrides_argument(p)


def main(config: Config, args) -> int:
    print("stopped" if controller.stop(default_state_dir(config)) else "no server was running")
    for state_dir in registered("bench"):  # (a bench stopped by SIGKILL could not stop its own)
        state = controller.running(state_dir)
        if state:
            controller.stop(state_dir)
            print(f"stopped the server a bench left running (pid {state['pid']}, {state_dir})")
        else:
            unregister(state_dir)
    return 0
