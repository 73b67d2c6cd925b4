"""Real training runs (single process) into a temporary MLflow store: tracking, bad input, kill + resume."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import cli, env_for, metric_history
from pipeline import REPO_ROOT, tracking

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
    refs = sorted(a.path for a in client.list_artifacts(run.info.run_id, "checkpoints"))
    assert refs == ["checkpoints/checkpoint-12.json", "checkpoints/checkpoint-6.json"]
    ref = json.loads(Path(client.download_artifacts(run.info.run_id, refs[0], str(tmp_path))).read_text())
    assert Path(ref["path"]).is_dir() and ref["eval_loss"] == pytest.approx(evals[12])
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "checkpoint-12"
    assert (run_dir / "config.yaml").is_file() and (run_dir / "tokenizer" / "vocab.txt").is_file()
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "tokenizer", "checkpoints"} <= artifacts


@pytest.mark.parametrize("case, overrides, message", [
    ("missing corpus", ["data.source=files", "data.files=[/nonexistent/corpus.txt]"], "does not exist"),
    ("empty corpus", ["data.source=files", "data.files=[{empty}]"], "corpus is empty"),
    ("unknown key", ["training.max_stepz=3"], "unknown key training.max_stepz"),
    ("negative steps", ["training.max_steps=-5"], "training.max_steps: must be > 0"),
    ("bad layout", ["parallel.tensor=3"], "must be divisible by parallel.tensor"),
])
def test_bad_input_fails_before_training(tiny_config, tmp_path, store_uri, case, overrides, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    runs = tmp_path / "runs"
    overrides = [o.replace("{empty}", str(empty)) for o in overrides]
    proc = cli(["train", "--config", str(tiny_config), f"training.runs_dir={runs}", *overrides], store_uri)
    assert proc.returncode == 2, proc.stderr[-2000:]
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0]
    assert not runs.exists() or not any(runs.iterdir())  # nothing half-written
    client = tracking.client(store_uri)
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []


def test_malformed_yaml_fails_with_one_line(tmp_path, store_uri):
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  max_steps: [3\n")
    proc = cli(["train", "--config", str(bad)], store_uri)
    assert proc.returncode == 2 and "malformed YAML at line" in proc.stderr


def test_killed_run_resumes_to_the_same_losses(tiny_config, tmp_path, store_uri):
    runs = tmp_path / "runs"
    common = ["--config", str(tiny_config), f"training.runs_dir={runs}", "training.max_steps=40",
              "training.eval_interval=5", "training.save_interval=5", "training.logging_interval=1"]
    full = cli(["train", *common, "training.run_name=full"], store_uri)
    assert full.returncode == 0, full.stderr[-3000:]

    # Interrupt a second run (Ctrl-C to its process group) once its first checkpoint is complete.
    victim = runs / "victim"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "train", *common, "training.run_name=victim"],
                            cwd=REPO_ROOT, env=env_for(store_uri), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not (victim / "checkpoints" / "checkpoint-5" / "checkpoint_complete.json").exists():
        assert proc.poll() is None and time.time() < deadline, "victim run ended before its first checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) != 0
    client = tracking.client(store_uri)
    run_id = run_id_of(victim)
    assert client.get_run(run_id).info.status == "KILLED"
    done = sorted(int(p.name.split("-")[1]) for p in (victim / "checkpoints").glob("checkpoint-*")
                  if (p / "checkpoint_complete.json").exists())
    assert done and done[-1] < 40, f"the run was not interrupted in time: {done}"

    resumed = cli(["train", "--resume", str(victim)], store_uri)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from {victim / 'checkpoints' / f'checkpoint-{done[-1]}'}" in resumed.stdout
    assert run_id_of(victim) == run_id and client.get_run(run_id).info.status == "FINISHED"
    expected = metric_history(client, run_id_of(runs / "full"), "loss")
    got = metric_history(client, run_id, "loss")
    after = [s for s in range(done[-1] + 1, 41)]
    assert after and all(got[s] == pytest.approx(expected[s], rel=1e-6, abs=1e-6) for s in after), \
        {s: (got[s], expected[s]) for s in after}
    # resume by MLflow run id is accepted too (nothing left to do: already at max_steps)
    again = cli(["train", "--resume", run_id, "--dry-run"], store_uri)
    assert again.returncode == 0, again.stderr[-2000:]
