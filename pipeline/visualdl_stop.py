"""`make visualdl-stop`: stop the dashboard `make visualdl` started (its whole process group)."""
from __future__ import annotations

from core.config import Config
from pipeline.runner import visualdl_server
from pipeline.runner.cli import config_argument, overrides_argument

HELP = "stop VisualDL's dashboard"


def arguments(p) -> None:
    config_argument(p)
    overrides_argument(p)


def main(config: Config, args) -> int:
    print("stopped" if visualdl_server.stop(config) else "no VisualDL dashboard was running")
    return 0
