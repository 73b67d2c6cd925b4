"""VisualDL logs' layout, shared by the writers (training/metrics/visualdl_writers.py), the launcher's stage report and the dashboard
(pipeline/runner/): a run's logs under runs/<run>/visualdl/, one directory per writer (train/, stage-<k>/,
pipeline/), and their tags; read back here."""
from __future__ import annotations

from pathlib import Path
import time

LOGDIR = "visualdl"
STAGE_TAGS = ("stage/forward_ms", "stage/backward_ms", "stage/step_ms", "stage/idle_ms")
IMBALANCE_TAG = "pipeline_parallel/stage_imbalance"


def new_file_name() -> str:
    """A writer's file: VisualDL names its own by the second and opens it for writing, so a second writer of one
    directory within that second would empty the first's file; nanoseconds (and sorting by name = by time)."""
    return f"vdlrecords.{time.time_ns():020d}.log"


def tag_of(metric: str) -> str:
    """MLflow's metric name -> the VisualDL tag (grouped into charts by the part before the slash)."""
    if metric.startswith("eval_"):
        return f"eval/{metric[len('eval_'):]}"
    if metric.startswith("checkpoint_"):
        return f"checkpoint/{metric[len('checkpoint_'):]}"
    return f"train/{metric}"


def scalar_records(logdir: Path):
    """(tag, step, value) of one writer directory as written: file after file (a resume's file after the launch it
    continues; the names sort by time), each tag's records in its file's order."""
    from visualdl import LogReader

    for path in sorted(Path(logdir).glob("vdlrecords.*.log")):
        reader = LogReader(file_path=str(path))
        for tag in reader.get_tags().get("scalar", []):
            for record in reader.get_data("scalar", tag):
                yield tag, int(record.id), float(record.value)


def read_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of one writer directory, over every file its launches wrote (`steps_in_order` shows a
    step written twice, which the writers never do)."""
    found: dict[str, dict[int, float]] = {}
    for tag, step, value in scalar_records(logdir):
        found.setdefault(tag, {})[step] = value
    return found


def steps_in_order(logdir: Path, tag: str) -> list[int]:
    """The steps of `tag` as written: a curve that went back or repeated a step shows here."""
    return [step for found, step, _ in scalar_records(logdir) if found == tag]
