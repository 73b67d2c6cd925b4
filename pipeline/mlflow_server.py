"""`make mlflow-server`: a real MLflow tracking server on 127.0.0.1 with the settings of mlflow/server.env
(pipeline/runner/tracking_server.py); its artifacts go to the object store when `make object-store` is up."""
from __future__ import annotations

from core import REPO_ROOT
from core.config import Config
from pipeline.runner import seaweedfs
from pipeline.runner.tracking_server import STATE_DIR, settings, start

HELP = "start a tracking server on 127.0.0.1 (settings: mlflow/server.env)"


def main(config: Config, args) -> int:
    s = settings()
    artifacts, store_env = REPO_ROOT / s["ARTIFACTS_DESTINATION"], None
    store = seaweedfs.running()
    if store:  # (`make object-store` is up: artifacts -- exports, registered versions -- go to it)
        artifacts, store_env = s.get("S3_ARTIFACTS_DESTINATION", "s3://mlflow/artifacts"), seaweedfs.environment(store)
        seaweedfs.ensure_bucket(store, artifacts)
    state = start(s["HOST"], int(s["PORT"]), REPO_ROOT / s["BACKEND_STORE"], artifacts, STATE_DIR,
                  int(s.get("WORKERS", "1")), store_env=store_env)
    print(f"MLflow tracking server: {state['url']} (pid {state['pid']}), artifacts in {artifacts}; use it with\n"
          f"  export MLFLOW_TRACKING_URI={state['url']}")
    return 0
