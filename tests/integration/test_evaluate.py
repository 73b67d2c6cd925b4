"""`make evaluate` and `make promote` on a real registry: evaluation reproduces training's eval loss and repeats
exactly; the alias moves only on evidence from the same held-out set, FORCE overrides, every move is recorded."""
import json
import threading
import time

import pytest

from core import tracking
from helpers import cli, metric_history, serving_ports, wait_until

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


LOAD_S, MOVE_AT_S, AFTER_S, CLIENTS = 20.0, 2.0, 3.0, 8


def _load(state: dict, i: int, stop: threading.Event, answers: list, failures: list) -> None:
    """One client until `stop`: odd ones on the OpenAI route, even ones on Paddle Serving's HTTP; each answer as
    (sent, received, the version that answered)."""
    import requests

    session = requests.Session()
    while not stop.is_set():
        sent = time.monotonic()
        try:
            if i % 2:
                r = session.post(f"{state['openai_base_url']}/completions", timeout=30,
                                 json={"model": "test-model", "prompt": "人工智能", "max_tokens": 8})
                version = r.json()["lineage"]["model_version"] if r.status_code == 200 else None
            else:
                r = session.post(state["http_url"], timeout=30, json={"key": ["prompt", "max_new_tokens"],
                                                                      "value": ["这本书", "8"]})
                body = r.json()
                version = dict(zip(body["key"], body["value"]))["model_version"] if body["err_no"] == 0 else None
            if version is None:
                failures.append(r.text[:300])
            else:
                answers.append((sent, time.monotonic(), version))
        except Exception as exc:  # noqa: BLE001
            failures.append(repr(exc))


@pytest.mark.alone  # (its load must run through the switch: an answer count)
def test_a_server_follows_its_alias_under_load_without_failing_a_request(versions):
    """8 clients (OpenAI route and Paddle Serving's HTTP) for 20 s (and at least 3 s past the switch: loading the new
    workers beside busy ones takes a while on 2 cores) while `make promote` moves the alias v1 -> v2: no request
    fails, every answer names v1 or v2, and every request sent after the first v2 answer is answered by v2."""
    client = versions["client"]
    client.set_registered_model_alias("test-model", "champion", "1")
    overrides = [*versions["overrides"], *serving_ports(), "serving.follow_interval_s=1"]
    proc = cli(["serve", *versions["base"], "--model", "models:/test-model@champion", *overrides], versions["uri"])
    assert proc.returncode == 0 and "follows models:/test-model@champion" in proc.stdout, proc.stderr[-3000:]
    state = json.loads((versions["root"] / "runs" / "serving" / "server.json").read_text())
    answers, failures, stop = [], [], threading.Event()
    threads = [threading.Thread(target=_load, args=(state, i, stop, answers, failures)) for i in range(CLIENTS)]
    began = time.monotonic()
    for t in threads:
        t.start()
    try:
        time.sleep(MOVE_AT_S)
        rc, out = promote(versions, 2, "--force")
        assert rc == 0, out
        def long_enough() -> bool:  # (20 s, and 3 s of answers after the first v2 answer)
            switched = [received for _, received, v in answers if v == "2"]
            return time.monotonic() - began >= LOAD_S and bool(switched) and time.monotonic() - min(switched) >= AFTER_S

        wait_until(long_enough, 90 - (time.monotonic() - began), 0.1)
    finally:
        stop.set()
        for t in threads:
            t.join()
        reloaded = cli(["reload", *versions["base"], *overrides], versions["uri"])
        stopped = cli(["stop", *versions["base"], *overrides], versions["uri"])
    log = (versions["root"] / "runs" / "serving" / "server.log").read_text()[-3000:]
    assert not failures, (failures[:5], log)
    assert {v for _, _, v in answers} == {"1", "2"}, ({v for _, _, v in answers}, log)
    first_v2 = min(received for _, received, v in answers if v == "2")
    late = [v for sent, _, v in answers if sent > first_v2]
    print(f"\nfollow under load: {len(answers)} answers ({sum(v == '1' for *_, v in answers)} v1, "
          f"{sum(v == '2' for *_, v in answers)} v2), {len(failures)} failed; first v2 answer at "
          f"{first_v2 - began:.1f} s of {max(r for _, r, _ in answers) - began:.1f} s")
    assert late and set(late) == {"2"}, f"{late.count('1')} answers by v1 after the switch"
    assert len(answers) > CLIENTS * 20  # (the load really ran through the switch)
    assert reloaded.returncode == 0 and "still serving test-model v2" in reloaded.stdout, reloaded.stdout
    assert stopped.returncode == 0
