"""Where MLflow lives and how the pipeline talks to it (through `mlflow.MlflowClient` only)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from urllib.parse import urlsplit
import math

from core import REPO_ROOT
from core.config import Config, ConfigError, TrackingConfig

MLFLOW_DIR = REPO_ROOT / "mlflow"
# MLflow 3.x refuses the plain ./mlruns file store, so the default local store is SQLite with artifacts beside it.
LOCAL_STORE = MLFLOW_DIR / "mlflow.db"
LOCAL_ARTIFACTS = MLFLOW_DIR / "artifacts"

# Tag and artifact names shared by the stages (train writes them, export/compare read them).
TAG_RUN_DIR = "pipeline.run_dir"
TAG_LAYOUT = "pipeline.layout"
CHECKPOINT_ARTIFACTS = "checkpoints"
EXPORT_ARTIFACTS = "exports"
TAG_HEARTBEAT = "pipeline.heartbeat"
TAG_LAUNCHER = "pipeline.launcher"  # host:pid:start-time of the `make train` process that drives the run
# Records a rank could not send during a tracking outage, kept in the run directory for the launcher to re-send.
UNSENT_RECORDS = "unsent_records.jsonl"
# A preference-tuning run's metrics (training/finetune/dpo.py), named as TRL and PaddleNLP name them; eval_ in front
# for the validation pairs
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                      "logps/rejected")


def tracking_uri(section: TrackingConfig | None = None) -> str:
    """The config's URI (its `tracking` section), else $MLFLOW_TRACKING_URI, else the local SQLite store under
    mlflow/."""
    if section is not None and section.tracking_uri:
        return section.tracking_uri
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{LOCAL_STORE}"


def display_uri(uri: str) -> str:
    """A tracking URI fit for a message: a password in it (http://user:secret@host) is left out."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    port = f":{parts.port}" if parts.port else ""
    return parts._replace(netloc=f"{parts.username}:***@{parts.hostname}{port}").geturl()


def is_local(uri: str) -> bool:
    return uri.startswith("sqlite:")


def local_artifact_root(uri: str) -> Path:
    """`artifacts/` beside a local SQLite store's file (a store elsewhere keeps its artifacts with it)."""
    path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
    return Path(path).resolve().parent / "artifacts" if path and path != ":memory:" else LOCAL_ARTIFACTS


def client(uri: str):
    import mlflow

    # MLflow retries a failed HTTP call 7 times with exponential backoff (minutes) by default: a few, then a clear
    # error. (Training workers set 0: they buffer and re-send instead.)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")

    if not is_local(uri):
        return mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    LOCAL_STORE.parent.mkdir(parents=True, exist_ok=True)
    # A new SQLite store is created and migrated by whichever process touches it first; several processes doing
    # that at once (runs started together) fail with "duplicate column name". One at a time, under a file lock.
    import fcntl

    db = Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else LOCAL_STORE
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        mlflow_client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
        mlflow_client.search_experiments(max_results=1)  # creates / migrates the tracking tables
        mlflow_client.search_registered_models(max_results=1)  # ... and the registry's
    return mlflow_client


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
    # Local store: artifacts beside the database (mlflow/artifacts for the default store); a server decides its own.
    location = (local_artifact_root(uri) / name).as_uri() if is_local(uri) else None
    try:
        return mlflow_client.create_experiment(name, artifact_location=location)
    except Exception:  # noqa: BLE001  (runs started together: another one created it a moment ago)
        experiment = mlflow_client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def log_dataset_input(mlflow_client, run_id: str, dataset_input) -> None:
    """`log_inputs` of one dataset input. MLflow's SQL store looks a dataset up and then inserts it, not atomically:
    two runs that start together with the same data set (a sweep's first runs) race, and the second fails with
    "UNIQUE constraint failed: datasets..." (its message also over REST). By then the dataset exists, and trying
    again links the run to it."""
    from mlflow.exceptions import MlflowException

    for attempt in range(3):
        try:
            mlflow_client.log_inputs(run_id, [dataset_input])
            return
        except MlflowException as exc:
            if attempt == 2 or not any(s in str(exc) for s in ("UNIQUE constraint failed", "Duplicate entry",
                                                               "duplicate key value")):
                raise


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def checkpoint_ref_path(step: int) -> str:
    """Artifact path of a checkpoint's record (step, local path, eval metrics, and `artifact` once uploaded)."""
    return f"{CHECKPOINT_ARTIFACTS}/checkpoint-{step}.json"


def checkpoint_artifact_path(step: int) -> str:
    """Artifact directory of an uploaded checkpoint."""
    return f"{CHECKPOINT_ARTIFACTS}/checkpoint-{step}"


def metric_record(key: str, value: float, step: int, timestamp_ms: int) -> dict:
    return {"kind": "metric", "key": key, "value": float(value), "step": int(step), "timestamp": int(timestamp_ms)}


def checkpoint_record(info: dict, upload: bool) -> dict:
    return {"kind": "checkpoint", "info": info, "upload": upload}


def send_records(mlflow_client, run_id: str, pending: list[dict]) -> None:
    """Send records in order and remove each from `pending` once it is sent; raises on the first failure, leaving
    the rest in `pending` (so a caller can keep them and retry). Metrics go in batches; a checkpoint is uploaded
    (when asked) before its record, so a record that names an `artifact` always has the files behind it."""
    from mlflow.entities import Metric

    while pending:
        if pending[0]["kind"] == "metric":
            n = 0
            while n < min(len(pending), 500) and pending[n]["kind"] == "metric":  # log_batch takes <= 1000
                n += 1
            mlflow_client.log_batch(run_id, metrics=[Metric(r["key"], r["value"], r["timestamp"], r["step"])
                                                     for r in pending[:n]])
            del pending[:n]
            continue
        info = dict(pending[0]["info"])
        if pending[0]["upload"]:
            mlflow_client.log_artifacts(run_id, info["path"], checkpoint_artifact_path(info["step"]))
            info["artifact"] = checkpoint_artifact_path(info["step"])
        mlflow_client.log_dict(run_id, info, checkpoint_ref_path(info["step"]))
        del pending[0]


def save_unsent(run_dir: Path, pending: list[dict]) -> None:
    with (Path(run_dir) / UNSENT_RECORDS).open("a") as fh:
        for record in pending:
            fh.write(json.dumps(record) + "\n")


def send_unsent(mlflow_client, run_id: str, run_dir: Path) -> int:
    """Re-send what the ranks could not (called by the launcher when it closes the run); returns how many."""
    path = Path(run_dir) / UNSENT_RECORDS
    if not path.exists():
        return 0
    pending = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    total = len(pending)
    try:
        send_records(mlflow_client, run_id, pending)
    finally:
        if pending:  # keep what is still unsent for the next try
            path.write_text("".join(json.dumps(r) + "\n" for r in pending))
        else:
            path.unlink()
    return total


def metric_history(client, run_id: str, key: str) -> dict[int, float]:
    """step -> value of a run's metric, in step order; a resumed run re-logs some steps: the last value wins."""
    latest: dict[int, float] = {}
    for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp)):
        latest[m.step] = m.value
    return dict(sorted(latest.items()))


def perplexity(loss: float) -> float:
    """exp(loss), capped so a diverged run logs a number instead of overflowing."""
    return math.exp(min(loss, 50.0))
