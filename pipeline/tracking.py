"""Where MLflow lives and how the pipeline talks to it (through `mlflow.MlflowClient` only)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from pipeline import REPO_ROOT
from pipeline.config import Config, ConfigError

MLFLOW_DIR = REPO_ROOT / "mlflow"
# MLflow 3.x refuses the plain ./mlruns file store, so the default local store is SQLite with artifacts beside it.
LOCAL_STORE = MLFLOW_DIR / "mlflow.db"
LOCAL_ARTIFACTS = MLFLOW_DIR / "artifacts"

# Tag and artifact names shared by the stages (train writes them, export/compare read them).
TAG_RUN_DIR = "pipeline.run_dir"
TAG_LAYOUT = "pipeline.layout"
CHECKPOINT_ARTIFACTS = "checkpoints"


def tracking_uri(config: Config | None = None) -> str:
    """The config's URI, else $MLFLOW_TRACKING_URI, else the local SQLite store under mlflow/."""
    if config is not None and config.tracking.tracking_uri:
        return config.tracking.tracking_uri
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{LOCAL_STORE}"


def is_local(uri: str) -> bool:
    return uri.startswith("sqlite:")


def client(uri: str):
    import mlflow

    if is_local(uri):
        LOCAL_STORE.parent.mkdir(parents=True, exist_ok=True)
    return mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with one line, when a remote tracking server does not answer (no silent local fallback)."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout_s).raise_for_status()
    except requests.RequestException as exc:
        raise ConfigError(f"MLflow tracking server {uri} is unreachable ({exc.__class__.__name__}); start it with "
                          f"`make mlflow-server` or unset MLFLOW_TRACKING_URI to use the local store") from None


def experiment_id(mlflow_client, name: str, uri: str) -> str:
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    # Local store: artifacts under mlflow/artifacts; a server decides its own artifact root.
    location = (LOCAL_ARTIFACTS / name).as_uri() if is_local(uri) else None
    return mlflow_client.create_experiment(name, artifact_location=location)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def as_path(artifact_uri: str) -> Path:
    """Local path of a file:// artifact URI."""
    from urllib.parse import unquote, urlparse

    return Path(unquote(urlparse(artifact_uri).path)) if artifact_uri.startswith("file:") else Path(artifact_uri)
