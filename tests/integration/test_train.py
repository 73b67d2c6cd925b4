"""Real training runs (single process) into a temporary MLflow store: tracking, bad input, kill + resume."""
import json
import math
import re
from pathlib import Path

import pytest

from helpers import cli, metric_history, wait_until
from core import tracking
pytestmark = pytest.mark.slow


def run_id_of(run_dir: Path) -> str:
    return json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]


def test_short_training_run_is_tracked(tiny_config, tmp_path, store_uri):
    runs = tmp_path / "runs"
    proc = cli(["train", "--config", str(tiny_config), f"training.runs_dir={runs}", "training.run_name=short",
                "training.max_steps=12", "training.eval_interval=6", "training.save_interval=6"], store_uri)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = runs / "short"
    client = tracking.client(store_uri)
    run = client.get_run(run_id_of(run_dir))
    assert run.info.status == "FINISHED"
    assert run.data.params["training.max_steps"] == "12" and run.data.params["model.hidden_size"] == "64"
    tags = run.data.tags
    for tag in ("git_commit", "paddle_version", "paddlenlp_version", "device", "world_size", "pipeline.layout"):
        assert tags[tag], tag
    assert tags[tracking.TAG_RUN_DIR] == str(run_dir)
    losses = metric_history(client, run.info.run_id, "loss")
    assert sorted(losses) == list(range(1, 13)) and all(v > 0 for v in losses.values())
    assert losses[12] < losses[1]
    evals = metric_history(client, run.info.run_id, "eval_loss")
    assert sorted(evals) == [6, 12]
    ppl = metric_history(client, run.info.run_id, "eval_perplexity")
    assert ppl[12] == pytest.approx(__import__("math").exp(evals[12]), rel=1e-6)
    for key in ("learning_rate", "tokens_per_second", "step_time_s"):
        assert metric_history(client, run.info.run_id, key), key
    # checkpoints: complete on disk, referenced from the run
    refs = sorted(a.path for a in client.list_artifacts(run.info.run_id, "checkpoints") if not a.is_dir)
    assert refs == ["checkpoints/checkpoint-12.json", "checkpoints/checkpoint-6.json"]
    ref = json.loads(Path(client.download_artifacts(run.info.run_id, refs[0], str(tmp_path))).read_text())
    assert Path(ref["path"]).is_dir() and ref["eval_loss"] == pytest.approx(evals[12])
    # tracking.checkpoint_artifacts=best (default): checkpoints that improved eval_loss are in the run's artifacts
    assert evals[12] < evals[6] and ref["artifact"] == "checkpoints/checkpoint-12"
    uploaded = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints/checkpoint-12")}
    assert {"checkpoints/checkpoint-12/model-00001-of-00001.safetensors",
            "checkpoints/checkpoint-12/optimizer-00001-of-00001.safetensors",
            "checkpoints/checkpoint-12/checkpoint_complete.json"} <= uploaded, uploaded
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "checkpoint-12"
    assert (run_dir / "config.yaml").is_file() and (run_dir / "tokenizer" / "vocab.txt").is_file()
    # the prepared data set: a training input of the run (mlflow.log_input convention) with its content key
    spec = json.loads((run_dir / "data" / "dataset.json").read_text())
    [data_input] = run.inputs.dataset_inputs
    profile = json.loads(data_input.dataset.profile)
    assert data_input.dataset.digest == spec["key"][:32] and Path(spec["path"]).name == spec["key"]
    assert [t.value for t in data_input.tags if t.key == "mlflow.data.context"] == ["training"]
    assert profile["train_tokens"] == int(run.data.params["data_stats.train_tokens"]) > 0
    assert profile["shards"] >= 1 and profile["blend"] == {"c0": 1.0}
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "tokenizer", "checkpoints"} <= artifacts
    # the console (stdout is a pipe here, not a terminal): plain progress lines and a summary; PaddleNLP's argument
    # dump and INFO/DEBUG lines only in the rank log
    out = proc.stdout
    assert "Training Configuration Arguments" not in out and "[   DEBUG]" not in out and "global_step" not in out
    assert "Training Configuration Arguments" in (run_dir / "logs" / "workerlog.0").read_text()
    assert f"run short: {run_dir}\n  MLflow run {run.info.run_id}: `make mlflow-ui`, then" in out
    assert "training steps 1..12: 256 tokens a step, 3,072 tokens = " in out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert re.fullmatch(r"step 12/12 \(100%\)  loss \d+\.\d{4}  eval_loss \d+\.\d{4}  [\d,]+ tok/s  ETA 0:00:00",
                        lines[-1]), lines
    assert f"eval_loss {evals[12]:.4f} (perplexity {math.exp(evals[12]):.1f}) at step 12" in out
    assert "next: make export" in out and "make compare" in out


@pytest.mark.parametrize("case, overrides, message", [
    ("missing corpus", ["data.source=files", "data.files=[/nonexistent/corpus.txt]"], "does not exist"),
    ("empty corpus", ["data.source=files", "data.files=[{empty}]"], "corpus is empty"),
    # (one config refusal through the CLI: the rules themselves are tests/unit/test_config.py's)
    ("unknown key", ["training.max_stepz=3"], "unknown key training.max_stepz"),
    ("binary corpus", ["data.source=files", "data.files=[{binary}]"], "contains NUL bytes (a binary file?)"),
    ("a step count at no scale", ["training.max_steps=1e12"], "its sample index needs"),
])
def test_bad_input_fails_before_training(tiny_config, tmp_path, store_uri, case, overrides, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    binary = tmp_path / "model.txt"
    binary.write_bytes(bytes(range(256)))
    runs = tmp_path / "runs"
    overrides = [o.replace("{empty}", str(empty)).replace("{binary}", str(binary)) for o in overrides]
    proc = cli(["train", "--config", str(tiny_config), f"training.runs_dir={runs}", *overrides], store_uri)
    assert proc.returncode == 2, proc.stderr[-2000:]
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0]
    assert not runs.exists() or not any(runs.iterdir())  # nothing half-written
    client = tracking.client(store_uri)
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []


def test_a_step_count_at_no_scale_is_refused_within_seconds(tiny_config, tmp_path, store_uri):
    """training.max_steps=1e12: refused in one line with the run's size before anything starts (its index once ran
    for minutes and would not fit in memory), with the step count that would fit."""
    import time

    assert cli(["data", "--config", str(tiny_config)], store_uri).returncode == 0  # (the data set exists already)
    began = time.monotonic()
    proc = cli(["train", "--config", str(tiny_config), f"training.runs_dir={tmp_path / 'runs'}",
                "training.max_steps=1e12"], store_uri)
    seconds = time.monotonic() - began
    assert proc.returncode == 2 and seconds < 10, (seconds, proc.stderr[-2000:])
    [error] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "training.max_steps=1,000,000,000,000: " in error and " epochs of the corpus" in error
    assert "use at most training.max_steps=" in error


@pytest.mark.parametrize("content, message", [
    ("training:\n  max_steps: [3\n".encode(), "malformed YAML at line 3"),
    ("training:\n  max_steps: 3 # 步数\n".encode("gbk"), "not UTF-8 text (byte 0xb2 at line 2)"),
])
def test_bad_yaml_fails_with_one_line(tmp_path, store_uri, content, message):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    proc = cli(["train", "--config", str(bad)], store_uri)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_three_runs_started_together_get_their_own_directories(tiny_config, tmp_path, store_uri):
    """As a sweep started from a shell loop does: three `make train` in one checkout at the same moment."""
    import subprocess

    from helpers import env_for, make_command
    from core import REPO_ROOT
    runs = tmp_path / "runs"
    args = (f"training.runs_dir={runs} training.max_steps=2 training.eval_interval=2 training.save_interval=2 "
            f"data.cache_dir={tmp_path / 'cache'}")
    procs = [subprocess.Popen(make_command("train", f"CONFIG={tiny_config}", f"ARGS={args}"), cwd=REPO_ROOT,
                              env=env_for(store_uri), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(3)]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], "\n".join(o[-1500:] for o in outputs)
    dirs = sorted(runs.iterdir())
    assert len(dirs) == 3 and all(d.name.startswith("t-") for d in dirs), dirs
    client = tracking.client(store_uri)
    found = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert sorted(r.data.tags[tracking.TAG_RUN_DIR] for r in found) == [str(d) for d in dirs]
    assert all(r.info.status == "FINISHED" for r in found)
    assert all((d / "checkpoints" / "checkpoint-2" / "checkpoint_complete.json").is_file() for d in dirs)


def test_a_taken_run_name_is_refused_without_suggesting_to_resume_it(tiny_config, tmp_path, store_uri):
    (tmp_path / "runs" / "mine").mkdir(parents=True)
    proc = cli(["train", "--config", str(tiny_config), f"training.runs_dir={tmp_path / 'runs'}",
                "training.run_name=mine"], store_uri)
    assert proc.returncode == 2
    assert "training.run_name='mine' is taken" in proc.stderr and "RESUME" not in proc.stderr
    assert list((tmp_path / "runs").iterdir()) == [tmp_path / "runs" / "mine"]


def test_a_full_disk_during_a_save_is_diagnosed_cleaned_up_and_resumes(tiny_config, tmp_path, store_uri):
    """A real full file system (a 64 MiB tmpfs; CI runs as root) filled after the first checkpoint: the run fails
    with one line naming the latest complete checkpoint and the RESUME command, no partial checkpoint is left, and
    after space is freed the run resumes to the end."""
    import os
    import subprocess

    from helpers import env_for, make_command
    from core import REPO_ROOT
    from training.checkpoint.local import COMPLETE_MARKER

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root: {mounted.stderr.decode().strip()}")
    try:
        run_dir, filler = disk / "runs" / "full", disk / "filler"
        proc = subprocess.Popen(
            make_command("train", f"CONFIG={tiny_config}",
                         f"ARGS=training.runs_dir={disk / 'runs'} training.run_name=full training.max_steps=60 "
                         f"data.cache_dir={tmp_path / 'cache'}"), cwd=REPO_ROOT, env=env_for(store_uri),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = run_dir / "checkpoints" / "checkpoint-3" / COMPLETE_MARKER
        assert wait_until(first.exists, 240, 0.05, alive=proc), "no first checkpoint"
        free = os.statvfs(disk)
        # leave ~200 KiB: logs go on a little, the next checkpoint (several MiB) cannot be written
        subprocess.run(["fallocate", "-l", str(free.f_bavail * free.f_frsize - 200 * 1024), str(filler)], check=True)
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode != 0
        line = next((l for l in stderr.splitlines() if l.startswith("disk full: ")), None)
        assert line is not None, stderr[-3000:]
        assert f"file system of {run_dir}" in line and f"make train RESUME={run_dir}" in line
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        assert f"latest complete checkpoint: {run_dir / 'checkpoints' / latest}" in line
        assert all((c / COMPLETE_MARKER).is_file() for c in (run_dir / "checkpoints").glob("checkpoint-*")), \
            "a partial checkpoint was left on the full disk"
        client = tracking.client(store_uri)
        run = client.get_run(run_id_of(run_dir))
        assert run.info.status == "FAILED" and run.data.tags["failure_kind"] == "disk_full"
        filler.unlink()
        # (fewer evaluations for the rest of the run: the point is that it resumes)
        resumed = cli(["train", "--resume", str(run_dir), "training.eval_interval=30", "training.save_interval=30"],
                      store_uri)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert client.get_run(run.info.run_id).info.status == "FINISHED"
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "checkpoint-60"
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
