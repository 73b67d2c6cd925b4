"""VisualDL's server over a run's logs, or an experiment's runs side by side (`make visualdl`, `make visualdl-stop`):
`visualdl --logdir ... --host visualdl.host --port visualdl.port`, in its own process group, its state in
<training.runs_dir>/visualdl-server/.

VisualDL 2.5.3 answers its page (/app/index) with a 500 to a request that has no Accept-Language header: its locale
selector returns None there, and Werkzeug 3 refuses a cookie whose value is None (visualdl/server/app.py
serve_static: `set_cookie('vdl_lng', get_locale())`). Browsers send the header, health checks and curl do not; the
server is started with `--language en`, so the locale is fixed and every request gets the page (OVERRIDES row in
core/workarounds/__init__.py). And with `--disable-telemetry`: by default its page loads Baidu's analytics script
(hm.baidu.com/hm.js), which a user's dashboard should not, and which is a console error on a machine without the
internet (seen in the browser test).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from core import tracking
from core.config import Config, ConfigError
from core.files import atomic_write
from core.processes import group_alive, log_tail, port_in_use, start_group, stop_recorded, wait_ready
from training.launch.rundir import runs_root
from training.metrics.visualdl_layout import LOGDIR  # (a run's logs under runs/<run>/visualdl/)



def state_dir(config: Config) -> Path:
    return runs_root(config.training) / "visualdl-server"


def logdir_for(config: Config, run: str) -> tuple[Path, str]:
    """(the directory VisualDL reads, what it shows): RUN= a run directory or a run's name under runs_dir (one run),
    an MLflow experiment (its runs side by side, through a directory of links named after the runs), or "" (the
    newest run that has logs)."""
    root = runs_root(config.training)
    if run and (Path(run) / LOGDIR).is_dir():
        return Path(run).resolve() / LOGDIR, f"run {Path(run).name}"
    if run and (root / run / LOGDIR).is_dir():
        return root / run / LOGDIR, f"run {run}"
    if not run:
        runs = sorted((d for d in root.glob(f"*/{LOGDIR}") if d.is_dir()), key=lambda d: d.stat().st_mtime)
        if not runs:
            raise ConfigError(f"no run under {root} has VisualDL logs yet; train one (make train), or RUN=<run>")
        return runs[-1], f"run {runs[-1].parent.name} (the newest)"
    client = tracking.client(tracking.tracking_uri(config.tracking))
    experiment = client.get_experiment_by_name(run)
    if experiment is None:
        raise ConfigError(f"RUN={run}: neither a run (a directory, or a name under {root}) nor an MLflow experiment "
                          f"in {tracking.display_uri(tracking.tracking_uri(config.tracking))}")
    view = state_dir(config) / f"experiment-{experiment.experiment_id}"
    view.mkdir(parents=True, exist_ok=True)
    for link in view.iterdir():
        link.unlink()
    shown = 0
    for found in client.search_runs([experiment.experiment_id], max_results=500):
        logs = Path(found.data.tags.get(tracking.TAG_RUN_DIR, "")) / LOGDIR
        if logs.is_dir():
            (view / found.info.run_name).symlink_to(logs, target_is_directory=True)
            shown += 1
    if not shown:
        raise ConfigError(f"RUN={run}: no run of experiment {run} has VisualDL logs on this machine")
    return view, f"{shown} run(s) of experiment {run}"


def start(config: Config, run: str = "", timeout_s: float = 60) -> dict:
    import requests

    v, here = config.visualdl, state_dir(config)
    state_file = here / "server.json"
    if state_file.exists() and group_alive(json.loads(state_file.read_text())["pid"]):
        raise ConfigError(f"VisualDL is already running ({json.loads(state_file.read_text())['url']}); "
                          "`make visualdl-stop` first")
    if port_in_use(v.port, v.host):
        raise ConfigError(f"port {v.port} is in use; set visualdl.port")
    logdir, what = logdir_for(config, run)
    here.mkdir(parents=True, exist_ok=True)
    command = [str(Path(sys.executable).parent / "visualdl"), "--logdir", str(logdir), "--host", v.host, "--port",
               str(v.port), "--language", "en", "--disable-telemetry"]  # (both: see the module's docstring)
    proc = start_group(command, here / "server.log", here, None)
    url = f"http://{v.host}:{v.port}"
    state = {"pid": proc.pid, "url": url, "logdir": str(logdir), "showing": what}
    atomic_write(state_file, json.dumps(state))
    if wait_ready(proc, lambda: requests.get(f"{url}/app/api/scalar/tags", timeout=2).ok, timeout_s) != "ready":
        stop(config)
        raise ConfigError("VisualDL did not answer; last log lines:\n" + log_tail(here / "server.log", 20))
    return state


def stop(config: Config) -> bool:
    return stop_recorded(state_dir(config) / "server.json")
