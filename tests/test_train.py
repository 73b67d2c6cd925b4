"""Real training runs (single process) into a temporary MLflow store: tracking, bad input, kill + resume."""
import json
from pathlib import Path

import pytest

from helpers import cli, metric_history
from pipeline import tracking

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
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "tokenizer", "checkpoints"} <= artifacts


@pytest.mark.parametrize("case, overrides, message", [
    ("missing corpus", ["data.source=files", "data.files=[/nonexistent/corpus.txt]"], "does not exist"),
    ("empty corpus", ["data.source=files", "data.files=[{empty}]"], "corpus is empty"),
    ("unknown key", ["training.max_stepz=3"], "unknown key training.max_stepz"),
    ("negative steps", ["training.max_steps=-5"], "training.max_steps: must be > 0"),
    ("bad layout", ["parallel.tensor=3"], "must be divisible by parallel.tensor"),
    ("binary corpus", ["data.source=files", "data.files=[{binary}]"], "contains NUL bytes (a binary file?)"),
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
