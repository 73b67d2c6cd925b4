"""`make sweep`: a 2 x 2 grid of real training runs, interrupted and continued (finished runs are not retrained),
ending with the comparison of its runs (the grid as logic: tests/unit/test_sweep_grid.py)."""
import json
import signal
import subprocess
import sys

import pytest

from helpers import cli, env_for, wait_until
from core import REPO_ROOT, tracking


@pytest.mark.slow
def test_a_2x2_sweep_interrupted_and_continued(tiny_config, tmp_path, store_uri):
    args = ["--config", str(tiny_config), "--id", "grid", "--parallel", "2", f"training.runs_dir={tmp_path / 'runs'}",
            f"data.cache_dir={tmp_path / 'cache'}", "training.max_steps=2", "training.eval_interval=2",
            "training.save_interval=2", "training.learning_rate=1e-3,3e-3", "model.num_layers=2,4"]
    # a bad value in the grid fails before anything runs
    bad = cli(["sweep", *args[:-1], "model.num_layers=2,0"], store_uri)
    assert bad.returncode == 2 and "model.num_layers: must be > 0" in bad.stderr
    assert not (tmp_path / "runs").exists()
    client = tracking.client(store_uri)

    def finished() -> dict:
        exp = client.get_experiment_by_name("tests")
        runs = client.search_runs([exp.experiment_id]) if exp else []
        return {r.info.run_name: r for r in runs if r.info.status == "FINISHED"}

    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "sweep", *args], cwd=REPO_ROOT, env=env_for(store_uri),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # interrupted once its first run has finished
    assert wait_until(lambda: bool(finished()), 300, 0.5, alive=proc, context=lambda: proc.stdout.read()[-3000:]), \
        "no run finished in 300 s"
    proc.send_signal(signal.SIGTERM)
    first, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, first[-3000:]
    done_before = {name: run.info.end_time for name, run in finished().items()}
    assert 1 <= len(done_before) < 4, first

    again = cli(["sweep", *args], store_uri)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    for name in done_before:
        assert f"{name}: finished earlier, not retrained" in again.stdout
    runs = finished()
    assert sorted(runs) == ["grid-00", "grid-01", "grid-02", "grid-03"]
    assert all(runs[name].info.end_time == end for name, end in done_before.items())  # not retrained
    assert {r.data.tags["pipeline.sweep"] for r in runs.values()} == {"grid"}
    assert {(r.data.params["training.learning_rate"], r.data.params["model.num_layers"]) for r in runs.values()} == {
        ("0.001", "2"), ("0.001", "4"), ("0.003", "2"), ("0.003", "4")}
    # the comparison of the sweep's runs, best first
    report = tmp_path / "runs" / "sweeps" / "grid" / "report"
    rows = (report / "runs.csv").read_text().splitlines()
    assert len(rows) == 5 and (report / "loss_curves.png").stat().st_size > 0
    best = [float(line.split(",")[14]) for line in rows[1:]]
    assert best == sorted(best)
    assert json.loads((tmp_path / "runs" / "sweeps" / "grid" / "sweep.json").read_text())["points"][0] == [
        "training.runs_dir=" + str(tmp_path / "runs"), f"data.cache_dir={tmp_path / 'cache'}", "training.max_steps=2",
        "training.eval_interval=2", "training.save_interval=2", "training.learning_rate=1e-3", "model.num_layers=2"]
