"""The MLflow run of a training run, from open to close, as one object.

A new run is created with what the run is (config params, layout, versions, data statistics, tokenizer); a resume
reopens the run directory's run (`mlflow_run.json`), marks it RUNNING and records a changed layout in tags (params are
immutable). While the launcher lives, a heartbeat stamps the run (stale runs: training/launch/liveness.py). At the end the
buffered records of a tracking outage are sent, the loss curve is attached, and the status is set; a failure adds the
failing rank's log tail and the kind of failure.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from importlib import metadata

from core import tracking
from core.config import Config
from core.layout import ParallelLayout
from core.workarounds import cpu_runtime
from training.launch import liveness
from core.files import atomic_write
from training.metrics import stage_report
from training.metrics.loss_plot import plot_run_losses

RUN_INFO = "mlflow_run.json"


def write_run_info(run_dir: Path, run_id: str, experiment_id: str, uri: str) -> None:
    """The run directory's link to its MLflow run, one shape wherever it is written (a new run, a restored one)."""
    atomic_write(run_dir / RUN_INFO, json.dumps({"run_id": run_id, "experiment_id": experiment_id,
                                                 "tracking_uri": uri}))
TAG_LAYOUT_HISTORY = "pipeline.layout_history"


class Heartbeat(threading.Thread):
    """Stamps the MLflow run every `interval_s` while the launcher lives (stale runs: training/launch/liveness.py)."""

    def __init__(self, mlflow_client, run_id: str, interval_s: float):
        super().__init__(daemon=True)
        self.client, self.run_id, self.interval_s, self.done = mlflow_client, run_id, interval_s, threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval_s):
            try:
                self.client.set_tag(self.run_id, tracking.TAG_HEARTBEAT, str(int(time.time())))
            except Exception:  # noqa: BLE001  (tracking outage: the metrics buffer says so; try again next beat)
                pass


class TrackedRun:
    def __init__(self, config: Config):
        self.config, self.uri = config, tracking.tracking_uri(config.tracking)
        self.client = None
        self.run_id: str | None = None
        self.previous_status: str | None = None  # a resumed run's status before this launch
        self.previous_layout: str | None = None
        self.heartbeat: Heartbeat | None = None

    def connect(self) -> "TrackedRun":
        """Check the tracking store answers, and mark the experiment's stale RUNNING runs FAILED."""
        tracking.check_reachable(self.uri)
        self.client = tracking.client(self.uri)
        for line in liveness.reap(self.client, self.config.tracking.experiment, self.config.tracking.stale_after_s):
            print(f"marked stale run FAILED: {line}", flush=True)
        return self

    def open(self, run_dir: Path, layout: ParallelLayout) -> None:
        """Create the MLflow run, or reopen the run directory's run on resume, and record what this launch is."""
        info_file = run_dir / RUN_INFO
        alive = {tracking.TAG_LAUNCHER: liveness.launcher_id(), tracking.TAG_HEARTBEAT: str(int(time.time()))}
        # the math runtime of this launch (a resume may run on another machine): see core/workarounds/cpu_runtime.py
        alive.update({f"runtime.{k}": v for k, v in cpu_runtime.describe(layout.threads_per_rank()).items()})
        if info_file.exists():
            self.run_id = json.loads(info_file.read_text())["run_id"]
            run = self.client.get_run(self.run_id)
            self.previous_status, self.previous_layout = run.info.status, run.data.tags.get(tracking.TAG_LAYOUT)
            self.client.update_run(self.run_id, status="RUNNING")
            self.client.log_batch(self.run_id, tags=[_tag(k, v) for k, v in alive.items()])
        else:
            self._create(run_dir, layout, alive)
            write_run_info(run_dir, self.run_id, self.experiment_id, self.uri)
        self.heartbeat = Heartbeat(self.client, self.run_id, self.config.tracking.heartbeat_s)

    def _create(self, run_dir: Path, layout: ParallelLayout, alive: dict) -> None:
        from mlflow.entities import Param, RunTag

        config = self.config
        self.experiment_id = tracking.experiment_id(self.client, config.tracking.experiment, self.uri)
        tags = {
            "mlflow.runName": run_dir.name, tracking.TAG_RUN_DIR: str(run_dir), tracking.TAG_LAYOUT: layout.name,
            "git_commit": tracking.git_commit(), "paddle_version": _version("paddlepaddle", "paddlepaddle-gpu"),
            "paddlenlp_version": _version("paddlenlp"), "device": layout.device, "world_size": str(layout.world_size),
            **{f"layout.{k}": str(v) for k, v in layout.as_params().items()}, **alive,
            **({"pipeline.sweep": config.tracking.sweep} if config.tracking.sweep else {}),
            # a fine-tuning run names what it starts from (lineage: runs:/<run>/..., models:/<name>/<version>)
            **({"pipeline.base": config.finetune.base, "finetune.method": config.finetune.method}
               if config.fine_tuning else {}),
        }
        self.run_id = self.client.create_run(self.experiment_id, tags=tags, run_name=run_dir.name).info.run_id
        params = {**config.flat(), **{f"layout.{k}": v for k, v in layout.as_params().items()}}
        stats_file = run_dir / "data" / "stats.json"
        stats = json.loads(stats_file.read_text()) if stats_file.exists() else {}
        params.update({f"data_stats.{k}": v for k, v in stats.items()})
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        first = [RunTag("pipeline.stage", "finetune" if config.fine_tuning else "train")]
        if config.preference_tuning:  # (the pairs' encoded set, and the reference the dpo rewards are against)
            first += [RunTag("finetune.preference_set", stats.get("data_set") or "in the run directory")]
            if "reference_model" in stats:
                first += [RunTag("finetune.reference", config.finetune.base),
                          RunTag("finetune.reference_key", stats["reference_model"])]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100], tags=first if i == 0 else [])
        self._log_dataset(run_dir)
        self.client.log_artifact(self.run_id, str(run_dir / "config.yaml"))
        self.client.log_artifacts(self.run_id, str(run_dir / "tokenizer"), "tokenizer")

    def _log_dataset(self, run_dir: Path) -> None:
        """The prepared data set as the run's training input (MLflow's dataset convention): its content key as the
        digest, its directory as the source, shards / tokens / blend weights as the profile."""
        spec_file, stats_file = run_dir / "data" / "dataset.json", run_dir / "data" / "stats.json"
        if not spec_file.exists() or not stats_file.exists():
            return
        from mlflow.entities import Dataset, DatasetInput, InputTag

        spec, stats = json.loads(spec_file.read_text()), json.loads(stats_file.read_text())
        profile = {k: stats[k] for k in ("shards", "train_tokens", "validation_tokens", "train_documents",
                                         "validation_documents", "blend")}
        entity = Dataset(name=f"data-{spec['key'][:12]}", digest=spec["key"][:36], source_type="local",
                         source=json.dumps({"uri": spec["path"]}), profile=json.dumps(profile))
        tracking.log_dataset_input(self.client, self.run_id,
                                   DatasetInput(entity, [InputTag("mlflow.data.context", "training")]))

    def web_link(self) -> str:
        try:
            experiment = self.client.get_run(self.run_id).info.experiment_id
        except Exception:  # noqa: BLE001  (the header never costs the run)
            experiment = "?"
        where = "`make mlflow-ui`, then http://127.0.0.1:5000" if tracking.is_local(self.uri) else self.uri.rstrip("/")
        return f"{where}/#/experiments/{experiment}/runs/{self.run_id}"

    def record_layout(self, layout: ParallelLayout, resume_from: Path | None) -> None:
        """Params are immutable in MLflow: a resume on another layout is recorded in tags."""
        if self.previous_layout in (None, layout.name):
            return
        try:
            tags = self.client.get_run(self.run_id).data.tags
            history = tags.get(TAG_LAYOUT_HISTORY, self.previous_layout)
            step = resume_from.name.split("-")[-1] if resume_from else "0"
            self.client.log_batch(self.run_id, tags=[
                _tag(tracking.TAG_LAYOUT, layout.name), _tag(TAG_LAYOUT_HISTORY, f"{history} -> {layout.name}@{step}"),
                *[_tag(f"layout.{k}", str(v)) for k, v in layout.as_params().items()]])
        except Exception as exc:  # noqa: BLE001
            print(f"MLflow: could not record the new layout ({exc.__class__.__name__})", file=sys.stderr, flush=True)

    def set_tag(self, key: str, value: str) -> None:
        try:
            self.client.set_tag(self.run_id, key, value[:5000])
        except Exception as exc:  # noqa: BLE001  (the console line says it too)
            print(f"MLflow: could not set {key} ({exc.__class__.__name__})", file=sys.stderr, flush=True)

    def record_failure(self, failure: dict) -> None:
        self.client.log_text(self.run_id, failure["tail"], f"failure/workerlog.{failure['rank']}.tail.txt")
        self.client.set_tag(self.run_id, "failed_rank", str(failure["rank"]))
        if failure["kind"]:
            self.client.set_tag(self.run_id, "failure_kind", failure["kind"])

    def record_stages(self, run_dir: Path, layout: ParallelLayout) -> None:
        """A pipeline run's per-stage times and advice (training/metrics/stage_report.py); never costs the run its status."""
        try:
            message = stage_report.report(self.client, self.run_id, run_dir, layout)
        except Exception as exc:  # noqa: BLE001
            message = f"pipeline stage report failed: {exc.__class__.__name__}: {exc}"
        if message:
            print(message, flush=True)

    def close(self, run_dir: Path, status: str) -> None:
        """Send what a tracking outage buffered, attach the loss curve of a finished run, set the status."""
        if self.heartbeat:
            self.heartbeat.done.set()
        try:
            sent = tracking.send_unsent(self.client, self.run_id, run_dir)
            if sent:
                print(f"MLflow: sent {sent} records buffered during a tracking outage", flush=True)
            if status == "FINISHED":
                png = plot_run_losses(self.client, self.run_id, run_dir / "loss_curve.png")
                self.client.log_artifact(self.run_id, str(png))
            self.client.set_terminated(self.run_id, status)
            print(f"MLflow run {self.run_id}: {status} (tracking URI {self.uri})", flush=True)
        except Exception as exc:  # noqa: BLE001  (tracking server gone: say so, keep the run directory)
            print(f"MLflow run {self.run_id}: could not record status {status} ({exc.__class__.__name__}); unsent "
                  f"metrics stay in {run_dir}", file=sys.stderr, flush=True)


def _tag(key: str, value: str):
    from mlflow.entities import RunTag

    return RunTag(key, value)


def _version(*distributions: str) -> str:
    """An installed package's version without importing it (importing paddlenlp would reset SIGTERM here)."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"
