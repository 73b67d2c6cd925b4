"""VisualDL's writers (training/metrics/visualdl_writers.py) and the launcher's stage imbalance (training/metrics/stage_report.py), on
real VisualDL log files: a killed launch and its resume leave one curve per tag, each step once and in order."""
from types import SimpleNamespace

import pytest

from training.metrics import visualdl_layout
from training.metrics.stage_report import imbalance_by_step, stage_imbalance
from training.metrics.visualdl_writers import StageWriter, VisualDLWriter

ARGS = SimpleNamespace(logging_steps=1)


def state(step: int):
    return SimpleNamespace(global_step=step)


def launch(logdir, steps, kill_after=None):
    """One launch logging `steps` (loss = 1/step, eval every 4th) through the MLflow logger's mirror hook; with
    `kill_after`, the process dies after that step's end (no train end)."""
    writer = VisualDLWriter(logdir, {"learning_rate": 0.1, "layout": "dp1"}, ("train/loss",))
    for step in steps:
        writer.on_step_end(ARGS, state(step), None)
        writer.add_metrics({"loss": 1 / step, "learning_rate": 0.1, **({"eval_loss": 2 / step} if step % 4 == 0
                                                                         else {})}, step)
        writer.on_log(ARGS, state(step), None, logs={"loss": 1 / step})
        if step == kill_after:
            writer.on_step_end(ARGS, state(step + 1), None)  # (the next step's end wrote this step's records)
            return writer  # (killed: never reaches on_train_end, its file stays as the kill left it)
    writer.on_train_end(ARGS, state(steps[-1]), None)
    return writer


def test_a_killed_launch_and_its_resume_leave_each_step_once_in_order(tmp_path):
    logdir = tmp_path / "visualdl" / "train"
    launch(logdir, range(1, 11), kill_after=9)  # killed after step 9; its newest checkpoint: step 6
    resumed = launch(logdir, range(7, 16))  # the resume trains 7..15 again from checkpoint 6, same numbers
    assert resumed.floor == 9
    assert visualdl_layout.steps_in_order(logdir, "train/loss") == list(range(1, 16))
    assert visualdl_layout.steps_in_order(logdir, "eval/loss") == [4, 8, 12]
    scalars = visualdl_layout.read_scalars(logdir)
    assert scalars["train/loss"] == pytest.approx({s: 1 / s for s in range(1, 16)})
    assert set(scalars) == {"train/loss", "train/learning_rate", "eval/loss", "memory/max_rss_mib"}
    assert len(list(logdir.glob("vdlrecords.*.log"))) == 2  # (one file per launch: the resume appended none to it)


def test_without_the_floor_a_resume_would_repeat_steps(tmp_path, monkeypatch):
    """(what the floor prevents: the same two launches, writing whatever they log)"""
    logdir = tmp_path / "train"
    launch(logdir, range(1, 11), kill_after=9)
    monkeypatch.setattr(visualdl_layout, "read_scalars", lambda path: {})
    monkeypatch.setattr("training.metrics.visualdl_writers.read_scalars", lambda path: {})
    launch(logdir, range(7, 16))
    assert visualdl_layout.steps_in_order(logdir, "train/loss") == [*range(1, 10), *range(7, 16)]


def test_metric_names_become_grouped_tags():
    assert [visualdl_layout.tag_of(k) for k in ("loss", "eval_loss", "eval_perplexity", "checkpoint_stall_s",
                                         "tokens_per_second")] == \
        ["train/loss", "eval/loss", "eval/perplexity", "checkpoint/stall_s", "train/tokens_per_second"]


class Timer:
    def __init__(self, steps):
        self.steps = iter(steps)

    def take_last(self):
        return next(self.steps, None)


def stage_logs(run_dir, per_stage: list[list[tuple[float, float]]], first_step=2):
    for k, times in enumerate(per_stage):
        writer = StageWriter(run_dir / "visualdl" / f"stage-{k}")
        writer.source = lambda t=Timer([{"forward_ms": f, "backward_ms": b, "step_ms": f + b + 1, "idle_ms": 1.0}
                                        for f, b in times]): t
        for i in range(len(times)):
            writer.on_step_end(ARGS, state(first_step + i), None)
        writer.on_train_end(ARGS, state(first_step + len(times)), None)


def test_every_stage_writes_the_same_tags_and_the_imbalance_is_each_steps_slowest_over_the_mean(tmp_path):
    stage_logs(tmp_path, [[(10, 20), (10, 20), (12, 24)], [(5, 10), (5, 10), (6, 12)]])
    for k in (0, 1):
        scalars = visualdl_layout.read_scalars(tmp_path / "visualdl" / f"stage-{k}")
        assert set(scalars) == set(visualdl_layout.STAGE_TAGS) and sorted(scalars["stage/forward_ms"]) == [2, 3, 4]
    found = imbalance_by_step(tmp_path)
    assert found == pytest.approx({2: 30 / 22.5, 3: 30 / 22.5, 4: 36 / 27})
    assert visualdl_layout.read_scalars(tmp_path / "visualdl" / "pipeline_parallel")[visualdl_layout.IMBALANCE_TAG] == pytest.approx(found)
    assert imbalance_by_step(tmp_path) == {}  # (a second report writes no step again)
    stage_logs(tmp_path, [[(9, 9)], [(9, 9)]], first_step=5)  # (a resumed launch's steps: appended)
    assert imbalance_by_step(tmp_path) == {5: 1.0}
    assert visualdl_layout.steps_in_order(tmp_path / "visualdl" / "pipeline_parallel", visualdl_layout.IMBALANCE_TAG) == [2, 3, 4, 5]


def test_the_summary_imbalance_is_the_slowest_stages_compute_over_the_mean():
    assert stage_imbalance([{"busy_ms_per_step": 30.0}, {"busy_ms_per_step": 15.0}]) == pytest.approx(30 / 22.5)
    assert stage_imbalance([{"busy_ms_per_step": 8.0}] * 4) == 1.0


def test_make_visualdl_serves_a_run_or_an_experiments_runs_side_by_side(tmp_path, monkeypatch):
    """RUN= a run's name or directory: its logs; an MLflow experiment: a directory of links, one per run (named after
    it) that has logs on this machine; nothing: the newest run; an unknown name: one line naming both lookups."""
    from core import tracking
    from core.config import ConfigError, load_config
    from pipeline.runner.visualdl_server import logdir_for

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = load_config(None, [f"training.runs_dir={tmp_path / 'runs'}", f"tracking.tracking_uri={uri}"])
    client = tracking.client(uri)
    experiment = client.create_experiment("sweep")
    for name in ("a", "b", "no-logs"):
        run_dir = tmp_path / "runs" / name
        (run_dir / ("visualdl" if name != "no-logs" else "other")).mkdir(parents=True)
        client.create_run(experiment, run_name=name, tags={tracking.TAG_RUN_DIR: str(run_dir)})
    assert logdir_for(config, "a") == (tmp_path / "runs" / "a" / "visualdl", "run a")
    assert logdir_for(config, str(tmp_path / "runs" / "b"))[0] == tmp_path / "runs" / "b" / "visualdl"
    view, what = logdir_for(config, "sweep")
    assert what == "2 run(s) of experiment sweep"
    assert {p.name: p.resolve() for p in view.iterdir()} == {n: tmp_path / "runs" / n / "visualdl" for n in "ab"}
    import os

    os.utime(tmp_path / "runs" / "a" / "visualdl", (1, 1))  # (b is the newer)
    assert logdir_for(config, "")[0] == tmp_path / "runs" / "b" / "visualdl"
    with pytest.raises(ConfigError, match="RUN=nothing: neither a run .* nor an MLflow experiment in sqlite"):
        logdir_for(config, "nothing")


def test_what_a_checkpoint_covers_is_written_before_it_can_be_resumed_from(tmp_path):
    """Losses logged every 5 steps (after the step's end), a checkpoint at 6, a kill at 8: step 5's loss was still
    held at the kill; the save wrote it, so the resume from 6 (which logs 10, 15) leaves no gap."""
    args = SimpleNamespace(logging_steps=5)
    first = VisualDLWriter(tmp_path / "train")
    for step in range(1, 9):
        first.on_step_end(args, state(step), None)
        if step % 5 == 0:
            first.add_metrics({"loss": 1 / step}, step)
        if step == 6:
            first.write_before_checkpoint()
    resumed = VisualDLWriter(tmp_path / "train")  # (the kill: `first` never wrote again)
    for step in range(7, 16):
        resumed.on_step_end(args, state(step), None)
        if step % 5 == 0:
            resumed.add_metrics({"loss": 1 / step}, step)
    resumed.on_train_end(args, state(15), None)
    assert visualdl_layout.steps_in_order(tmp_path / "train", "train/loss") == [5, 10, 15]
