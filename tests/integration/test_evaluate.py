"""`make evaluate` and `make promote` on a real registry: evaluation reproduces training's eval loss and repeats
exactly; the alias moves only on evidence from the same held-out set, FORCE overrides, every move is recorded."""
import json

import pytest

from core import tracking
from helpers import cli, metric_history

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def versions(exported):
    """v1: the session's export (12 steps); v2: a worse one (2 steps) from another run on the same data."""
    base = ["--config", str(exported["config"])]
    proc = cli(["train", *base, "training.run_name=worse", "training.max_steps=2", "training.eval_interval=2",
                "training.save_interval=2", *exported["overrides"][:3]], exported["uri"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = json.loads((exported["root"] / "runs" / "worse" / "mlflow_run.json").read_text())["run_id"]
    proc = cli(["export", *base, "--run-id", run_id], exported["uri"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**exported, "base": base, "client": tracking.client(exported["uri"])}


def evaluate(v, version) -> tuple[int, str]:
    proc = cli(["evaluate", *v["base"], "--model", f"models:/test-model/{version}"], v["uri"])
    return proc.returncode, proc.stdout + proc.stderr


def promote(v, version, *extra) -> tuple[int, str]:
    proc = cli(["promote", *v["base"], "--model", f"models:/test-model/{version}", *extra], v["uri"])
    return proc.returncode, proc.stdout + proc.stderr


def test_evaluation_reproduces_training_and_promotion_follows_the_evidence(versions):
    client = versions["client"]
    assert evaluate(versions, 1)[0] == 0
    first = client.get_model_version("test-model", "1").tags
    assert evaluate(versions, 1)[0] == 0
    again = client.get_model_version("test-model", "1").tags
    digest = first["eval.dataset"]
    assert {k: v for k, v in first.items() if k.startswith("eval.") and k != "eval.run_id"} == \
        {k: v for k, v in again.items() if k.startswith("eval.") and k != "eval.run_id"}  # (identical metrics)
    source = client.get_model_version("test-model", "1").run_id
    best = min(metric_history(client, source, "eval_loss").values())
    assert float(first[f"eval.{digest}.eval_loss"]) == pytest.approx(best, abs=1e-4)
    run = client.get_run(first["eval.run_id"])
    assert run.data.tags["model_uri"] == "models:/test-model/1" and run.inputs.dataset_inputs[0].dataset.digest == \
        digest and run.data.metrics["perplexity"] > 1
    assert "generations.json" in {a.path for a in client.list_artifacts(run.info.run_id)}

    rc, out = promote(versions, 1)
    assert rc == 0 and "test-model@champion -> v1 (it was unset)" in out
    rc, out = promote(versions, 2)  # v2 has no evaluation yet
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and "run make evaluate MODEL=models:/test-model/2" in errors[0], out
    assert evaluate(versions, 2)[0] == 0
    worse = float(client.get_model_version("test-model", "2").tags[f"eval.{digest}.eval_loss"])
    better = float(first[f"eval.{digest}.eval_loss"])
    assert worse > better
    rc, out = promote(versions, 2)
    assert rc == 2 and f"eval_loss {worse:.4f} > {better:.4f}; the alias stays" in out, out
    assert str(client.get_model_version_by_alias("test-model", "champion").version) == "1"
    rc, out = promote(versions, 2, "--force")
    assert rc == 0 and str(client.get_model_version_by_alias("test-model", "champion").version) == "2"
    record = json.loads(client.get_model_version("test-model", "2").tags["promotion.champion"])
    assert (record["from"], record["forced"], record["dataset"], record["new"], record["old"]) == \
        ("1", True, digest, pytest.approx(worse), pytest.approx(better))
    rc, out = promote(versions, 1)  # back: as good or better on the same set
    assert rc == 0 and str(client.get_model_version_by_alias("test-model", "champion").version) == "1"
    record = json.loads(client.get_model_version("test-model", "1").tags["promotion.champion"])
    assert record["from"] == "2" and not record["forced"]
