"""The run and checkpoint a verb starts from, chosen in MLflow and fetched to this machine (export exports it,
finetune fine-tunes it): `select` the best checkpoint (lowest metric) of the best FINISHED run, or of RUN_ID;
`fetch_inputs` its checkpoint, config and tokenizer, from this machine's disk or the run's artifacts."""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
import logging
import os

from core import tracking
from export import ExportError
from training.checkpoint.local import COMPLETE_MARKER


@dataclass
class Selection:
    run_id: str
    run_name: str
    info: dict  # the checkpoint's record: step, path (on the training machine), eval metrics, artifact if uploaded
    metric: str

    @property
    def step(self) -> int:
        return int(self.info["step"])

    @property
    def metric_value(self) -> float:
        return float(self.info[self.metric])

    @property
    def local_checkpoint(self) -> Path | None:
        path = Path(self.info["path"])
        return path if (path / COMPLETE_MARKER).is_file() else None


def quiet_libraries() -> None:
    """The export's console says what it does; the libraries' chatter is switched off where it starts:
    Paddle's C++ INFO lines ("New Executor is Running", before paddle loads), PaddleNLP's INFO lines (model
    loading), MLflow's per-file download bars and its notes while saving the pyfunc model (its cloudpickle warning
    included: the pickled class is this repository's own, shipped in the model's code/)."""
    os.environ.setdefault("GLOG_minloglevel", "2")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow  # noqa: F401  (it configures its loggers at import: set the level after)

    logging.getLogger("mlflow").setLevel(logging.ERROR)
    from paddlenlp.utils.log import logger

    logger.set_level("WARNING")


def select(client, experiment: str, metric: str, run_id: str = "", step: int | None = None) -> Selection:
    """The best checkpoint (lowest `metric`) of the best FINISHED run, or of RUN_ID, that this machine can read:
    on its disk, or uploaded to the run's artifacts (tracking.checkpoint_artifacts); or that run's checkpoint `step`."""
    run = _source_run(client, experiment, metric, run_id)
    refs = [a.path for a in client.list_artifacts(run.info.run_id, tracking.CHECKPOINT_ARTIFACTS)
            if not a.is_dir and a.path.endswith(".json")]
    candidates = []
    with tempfile.TemporaryDirectory() as tmp:
        for ref in refs:
            info = json.loads(Path(client.download_artifacts(run.info.run_id, ref, tmp)).read_text())
            readable = (Path(info["path"]) / COMPLETE_MARKER).is_file() or info.get("artifact")
            if metric in info and readable and step in (None, int(info["step"])):
                candidates.append(info)
    if not candidates:
        raise ExportError(f"run {run.info.run_id} has no checkpoint" + (f"-{step}" if step is not None else "")
                          + f" with metric {metric!r} on this machine or in its MLflow artifacts ({len(refs)} "
                          "recorded; see tracking.checkpoint_artifacts)")
    best = min(candidates, key=lambda info: (info[metric], -info["step"]))
    return Selection(run_id=run.info.run_id, run_name=run.info.run_name, info=best, metric=metric)


def _source_run(client, experiment: str, metric: str, run_id: str):
    """RUN_ID's run; RUN_ID=latest: the experiment's newest FINISHED run (`make all-chat` exports the run it just
    trained); else the experiment's FINISHED run with the lowest `metric`."""
    if run_id and run_id != "latest":
        try:
            return client.get_run(run_id)
        except Exception:  # noqa: BLE001  (MlflowException for unknown ids, varies by store)
            raise ExportError(f"RUN_ID={run_id}: no such MLflow run") from None
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ExportError(f"EXPERIMENT={experiment}: no such MLflow experiment")
    order = "attributes.start_time DESC" if run_id == "latest" else f"metrics.{metric} ASC"
    runs = [r for r in client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'",
                                          order_by=[order], max_results=200)
            if metric in r.data.metrics]
    if not runs:
        raise ExportError(f"experiment {experiment!r} has no FINISHED run with metric {metric!r}; train first")
    return runs[0]


def fetch_inputs(client, chosen: Selection, scratch: Path) -> tuple[Path, Path, Path]:
    """(checkpoint, config.yaml, tokenizer/) of the chosen run: from the training machine's run directory when it
    is here, else downloaded from the run's MLflow artifacts into `scratch`."""
    checkpoint = chosen.local_checkpoint
    if checkpoint is not None:
        run_dir = checkpoint.parent.parent
        return checkpoint, run_dir / "config.yaml", run_dir / "tokenizer"
    print(f"checkpoint-{chosen.step} is not on this machine: downloading {chosen.info['artifact']} from the run's "
          f"MLflow artifacts", flush=True)
    try:
        checkpoint = Path(client.download_artifacts(chosen.run_id, chosen.info["artifact"], str(scratch)))
        config = Path(client.download_artifacts(chosen.run_id, "config.yaml", str(scratch)))
        tokenizer = Path(client.download_artifacts(chosen.run_id, "tokenizer", str(scratch)))
    except Exception as exc:  # noqa: BLE001  (store / network errors)
        raise ExportError(f"could not download checkpoint-{chosen.step} of run {chosen.run_id} "
                          f"({exc.__class__.__name__}: {str(exc)[:200]})") from None
    return checkpoint, config, tokenizer
