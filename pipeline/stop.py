"""`make stop`: drain the running endpoint (requests in flight finish) and stop its whole process group."""
from __future__ import annotations

from core.config import Config
from serving import controller
from serving.state import default_state_dir


def main(config: Config, args) -> int:
    print("stopped" if controller.stop(default_state_dir(config)) else "no server was running")
    return 0
