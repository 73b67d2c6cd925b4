"""The pages this project serves, in a real browser (Debian's headless Chromium, tests/browser.py): VisualDL's
dashboard over a finished pp2 run (`make visualdl`) shows the loss chart and the per-stage timing chart with a line
for each stage, with no console error; `make mlflow-ui`'s page for the same run shows its loss metric. Screenshots of
both go to the test's output directory."""
import json
import subprocess
import sys

import pytest
import requests

from browser import Browser
from core import REPO_ROOT
from core.processes import free_port, port_in_use, start_group, stop_group, wait_ready
from helpers import LAYOUTS, cli, seeded_world, wait_until

pytestmark = pytest.mark.slow
# a tag group's header on VisualDL's scalars page (an <h3> with the group's name)
GROUP = "((name) => [...document.querySelectorAll('h3')].find(e => e.textContent.trim() === name))"


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory):
    world = seeded_world(tmp_path_factory.mktemp("monitoring"))
    proc = cli(["train", "--config", str(world["config"]), f"training.runs_dir={world['runs']}",
                "training.run_name=watched", f"model.init_from={world['weights']}", *LAYOUTS["pp2"]], world["uri"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = world["runs"] / "watched"
    return {**world, "run_dir": run_dir, "run_id": json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]}


def test_visualdl_shows_the_loss_and_a_line_per_stage_in_a_browser(pp2_run, tmp_path):
    port = free_port()
    common = ["--config", str(pp2_run["config"]), f"training.runs_dir={pp2_run['runs']}", f"visualdl.port={port}"]
    started = cli(["visualdl", "--run", "watched", *common], pp2_run["uri"], timeout=120)
    assert started.returncode == 0, started.stderr[-3000:]
    assert f"VisualDL: http://127.0.0.1:{port}/app/scalar" in started.stdout, started.stdout
    try:
        # (VisualDL 2.5.3 without --language answers a request without Accept-Language with a 500)
        assert requests.get(f"http://127.0.0.1:{port}/app/index", timeout=10).status_code == 200
        with Browser() as browser:
            page = browser.open(f"http://127.0.0.1:{port}/app/scalar")
            page.wait_for(f"{GROUP}('stage') && {GROUP}('train')")  # (the tag groups; the first one is open)
            page.evaluate(f"{GROUP}('train').click(), {GROUP}('stage').click()")  # (open the loss and stage charts)
            # (a chart is a canvas, its title drawn in it: checkpoint's 1, stage's 4 and train's 8 charts)
            page.wait_for("document.querySelectorAll('canvas').length >= 13")
            page.drain(3)  # (the charts' data requests)
            page.evaluate(f"{GROUP}('stage').scrollIntoView()")
            shot = page.screenshot(tmp_path / "visualdl-stages.png")
            errors, fetched = page.console_errors, page.requests
        data = [url for url in fetched if "/api/scalar/list" in url]
        for stage in ("stage-0", "stage-1"):  # a line per stage: the page fetched the stage tag of each stage's run
            assert any(stage in url and "stage%2Fforward_ms" in url for url in data), data
        assert any("train" in url and "train%2Floss" in url for url in data), data
        assert not errors, errors
        assert shot.stat().st_size > 20_000  # (a rendered page, not a blank one)
        print(f"screenshot: {shot}")
    finally:
        stopped = cli(["visualdl-stop", *common], pp2_run["uri"], timeout=60)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert wait_until(lambda: not port_in_use(port), 10), "VisualDL still listens after make visualdl-stop"


def test_the_mlflow_ui_shows_the_runs_loss_in_a_browser(pp2_run, tmp_path):
    """`make mlflow-ui`'s server (`mlflow ui`) over the run's store; the run's page lists its loss metric."""
    port = free_port()
    proc = start_group([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", pp2_run["uri"], "--host",
                        "127.0.0.1", "--port", str(port)], tmp_path / "mlflow-ui.log", REPO_ROOT, None)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_ready(proc, lambda: requests.get(f"{url}/health", timeout=2).ok, 120) == "ready", \
            (tmp_path / "mlflow-ui.log").read_text()[-2000:]
        from core import tracking

        run = tracking.client(pp2_run["uri"]).get_run(pp2_run["run_id"])
        with Browser() as browser:
            page = browser.open(f"{url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}/model-metrics")
            page.wait_for("document.body.innerText.includes('watched')")
            page.wait_for("document.body.innerText.includes('watched (loss)')")
            text = page.evaluate("document.body.innerText")
            shot = page.screenshot(tmp_path / "mlflow-run.png")
        # (the run's loss chart: its title and its legend entry for this run; drawn from the metric's history)
        assert "\nloss\n" in text and "watched (loss)" in text, text[:3000]
        assert shot.stat().st_size > 20_000
        print(f"screenshot: {shot}")
    finally:
        stop_group(proc.pid)
        proc.wait()
