"""Experiment comparison, a real MLflow tracking server over HTTP, and tracking-server failures."""
import json
import subprocess
import sys

import pytest

from helpers import cli, env_for, free_port, metric_history, wait_for_event
from core import REPO_ROOT, tracking
from pipeline.runner import tracking_server
from core.processes import group_alive, port_in_use

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path):
    port = free_port()
    state_dir = tmp_path / "server"
    state = tracking_server.start("127.0.0.1", port, tmp_path / "store" / "mlflow.db", tmp_path / "artifacts",
                                state_dir)
    yield {**state, "port": port, "state_dir": state_dir, "tmp": tmp_path}
    tracking_server.stop(state_dir)
    assert not group_alive(state["pid"]) and not port_in_use(port), "tracking server left behind"


def test_train_and_compare_over_http(server, tiny_config, tmp_path):
    runs = tmp_path / "runs"
    for name, lr in (("lr-high", 0.01), ("lr-low", 0.0005)):
        proc = cli(["train", "--config", str(tiny_config), f"training.runs_dir={runs}", f"training.run_name={name}",
                    f"training.learning_rate={lr}", "training.max_steps=6"], server["url"])
        assert proc.returncode == 0, proc.stderr[-3000:]
    from pipeline.runner.comparison import compare, table

    rows, out_dir = compare("tests", uri=server["url"], out_dir=tmp_path / "report")
    assert [r["run"] for r in rows] == sorted([r["run"] for r in rows], key=lambda n: [
        x["best_eval_loss"] for x in rows if x["run"] == n][0])
    assert {r["run"] for r in rows} == {"lr-high", "lr-low"} and all(r["status"] == "FINISHED" for r in rows)
    assert rows[0]["best_eval_loss"] <= rows[1]["best_eval_loss"]
    assert {r["lr"] for r in rows} == {"0.01", "0.0005"}
    md = (out_dir / "runs.md").read_text()
    assert "lr-high" in md and "lr-low" in md
    assert len((out_dir / "runs.csv").read_text().splitlines()) == 3
    png = (out_dir / "loss_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "lr-high" in table(rows)
    client = tracking.client(server["url"])
    artifacts = {a.path for a in client.list_artifacts(rows[0]["run_id"])}
    assert "loss_curve.png" in artifacts  # each run logs its own curve


def test_compare_cli_on_local_store(tiny_config, tmp_path, store_uri):
    proc = cli(["train", "--config", str(tiny_config), f"training.runs_dir={tmp_path / 'runs'}",
                "training.max_steps=3", "training.eval_interval=3", "training.save_interval=3"], store_uri)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = cli(["compare", "--experiment", "tests", "--out", str(tmp_path / "report")], store_uri)
    assert proc.returncode == 0 and "1 runs of 'tests'" in proc.stdout, proc.stderr[-2000:]
    assert (tmp_path / "report" / "runs.csv").read_text().count("\n") == 2  # the header and the run


def test_unreachable_tracking_server_refuses_to_train(tiny_config, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    proc = cli(["train", "--config", str(tiny_config), f"training.runs_dir={tmp_path / 'runs'}"], url)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is unreachable" in errors[0]
    assert not (tmp_path / "runs").exists()


def test_tracking_outage_mid_run_loses_no_metrics(server, tiny_config, tmp_path):
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "pipeline", "train", "--config", str(tiny_config), f"training.runs_dir={runs}",
           "training.run_name=outage", "training.max_steps=150", "training.eval_interval=50",
           "training.save_interval=50"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env_for(server["url"]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    run_dir = runs / "outage"
    wait_for_event(run_dir, lambda e: e["kind"] == "log" and e["step"] >= 5, proc, "step 5")
    tracking_server.stop(server["state_dir"])  # the server goes away mid-run ...
    wait_for_event(run_dir, lambda e: e["kind"] == "note" and "logging failed" in e["text"], proc,
                   "the logging failure noticed by rank 0")
    tracking_server.start("127.0.0.1", server["port"], server["tmp"] / "store" / "mlflow.db",
                        server["tmp"] / "artifacts", server["state_dir"])  # ... and comes back
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "logging failed" in stdout + stderr  # the warning reached the console
    run_id = json.loads((runs / "outage" / "mlflow_run.json").read_text())["run_id"]
    client = tracking.client(server["url"])
    assert client.get_run(run_id).info.status == "FINISHED"
    assert sorted(metric_history(client, run_id, "loss")) == list(range(1, 151))
