"""`make mlflow-server`: a real MLflow tracking server on 127.0.0.1 with the settings of mlflow/server.env
(pipeline/runner/tracking_server.py)."""
from __future__ import annotations

from core import REPO_ROOT
from core.config import Config
from pipeline.runner.tracking_server import STATE_DIR, settings, start


def main(config: Config, args) -> int:
    s = settings()
    state = start(s["HOST"], int(s["PORT"]), REPO_ROOT / s["BACKEND_STORE"], REPO_ROOT / s["ARTIFACTS_DESTINATION"],
                  STATE_DIR, int(s.get("WORKERS", "1")))
    print(f"MLflow tracking server: {state['url']} (pid {state['pid']}); use it with\n"
          f"  export MLFLOW_TRACKING_URI={state['url']}")
    return 0
