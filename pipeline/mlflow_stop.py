"""`make mlflow-stop`: stop the tracking server `make mlflow-server` started (its whole process group)."""
from __future__ import annotations

from core.config import Config
from pipeline.runner.tracking_server import STATE_DIR, stop

HELP = "stop the tracking server"


def main(config: Config, args) -> int:
    print("stopped" if stop(STATE_DIR) else "no MLflow server was running")
    return 0
