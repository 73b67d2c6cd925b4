"""`make sweep`: train a grid of overrides, a few runs at a time, and compare them.

    python -m pipeline sweep --config configs/tiny.yaml training.learning_rate=1e-3,3e-3 model.num_layers=2,4
                             [--id <sweep id>] [--parallel N]

`key=v1,v2,...` gives a key several values (the grid is every combination); `key=v` is the same for every run. Every
point's config is validated before the first run starts. Each point is a normal `pipeline train` run named
`<sweep id>-<nn>` in the config's experiment, tagged `pipeline.sweep=<sweep id>` (tracking.sweep); the sweep's
plan, per-run logs and report live in `<runs_dir>/sweeps/<sweep id>/`. At most N runs train at once (default:
what the machine's cores hold for the layout), each with its share of the cores. Run the same command with
`--id <sweep id>` to continue an interrupted sweep: finished runs are not retrained, stopped ones resume from their
latest checkpoint, the rest start. The sweep ends with `make compare`'s table of its runs, best first, and their
loss curves.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from core import REPO_ROOT, tracking

from core.workarounds import cpu_runtime
from core.config import Config, ConfigError, load_config
from core.config_loading import parse_override
from core.config import DEFAULT_CONFIG
from pipeline.runner import comparison
from pipeline.runner.cli import config_argument, overrides_argument

HELP = "train a grid of overrides (key=v1,v2 ...), N at a time, then compare them"
OWN_OVERRIDES = True  # (a grid, not one config)


def arguments(p) -> None:
    config_argument(p)
    p.add_argument("--id", default="", help="continue this sweep (finished runs are not retrained)")
    p.add_argument("--parallel", type=int, default=0, help="runs at once (default: what the cores hold)")
    overrides_argument(p, "e.g. training.learning_rate=1e-3,3e-3 model.num_layers=2,4")


def grid(overrides: list[str]) -> list[list[str]]:
    """`a=1,2 b=x` -> [[a=1, b=x], [a=2, b=x]]. A value in brackets (a YAML list) is one value."""
    axes = []
    for text in overrides:
        parse_override(text)  # (the key=value shape, with a clear error)
        key, raw = text.split("=", 1)
        values = [raw] if raw.strip().startswith("[") else [v.strip() for v in raw.split(",")]
        if any(v == "" for v in values):
            raise ConfigError(f"sweep override {text!r}: an empty value in the list")
        axes.append([f"{key}={v}" for v in values])
    return [list(point) for point in itertools.product(*axes)] if axes else [[]]


def plan(config_path: str, overrides: list[str], sweep_id: str) -> tuple[list[dict], Config]:
    """The sweep's points, each validated (a bad value fails here, before anything runs), and the first point's
    config (its runs directory, experiment and tracking URI are the sweep's)."""
    points, configs = [], []
    fixed = {o for o in overrides if "," not in o or o.split("=", 1)[1].strip().startswith("[")}
    for i, point in enumerate(grid(overrides)):
        name = f"{sweep_id}-{i:02d}"
        configs.append(load_config(config_path, [*point, f"training.run_name={name}", f"tracking.sweep={sweep_id}"]))
        points.append({"name": name, "overrides": point, "varies": [o for o in point if o not in fixed],
                       "world_size": configs[-1].layout().world_size})
    return points, configs[0]


def _status(client, experiment: str, name: str) -> str | None:
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    found = client.search_runs([exp.experiment_id], f"attributes.run_name = '{name}'")
    return found[0].info.status if found else None


def run(config: Config, config_path: str, overrides: list[str], sweep_id: str = "", parallel: int = 0) -> int:
    """`config` is the file at `config_path` (the runs are launched with that path and each point's overrides)."""
    sweep_id = sweep_id or f"{config.name}-sweep-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    points, base = plan(config_path, overrides, sweep_id)
    home = (REPO_ROOT / base.training.runs_dir).resolve() / "sweeps" / sweep_id
    home.mkdir(parents=True, exist_ok=True)
    saved = home / "sweep.json"
    if saved.exists() and json.loads(saved.read_text())["points"] != [p["overrides"] for p in points]:
        raise ConfigError(f"sweep {sweep_id} exists with another grid ({saved}); continue it with the same overrides "
                          f"or start a new sweep (leave --id empty)")
    saved.write_text(json.dumps({"config": str(config_path), "points": [p["overrides"] for p in points]}, indent=2))
    cores = cpu_runtime.available_cores()
    widest = max(p["world_size"] for p in points)
    at_once = parallel or max(1, cores // widest)
    threads = max(1, cores // (at_once * widest))
    uri = tracking.tracking_uri(base.tracking)
    client = tracking.client(uri)
    experiment = base.tracking.experiment
    print(f"sweep {sweep_id}: {len(points)} runs, {at_once} at a time ({threads} thread(s) per process); logs "
          f"in {home}", flush=True)
    todo = []
    for point in points:
        status = _status(client, experiment, point["name"])
        if status == "FINISHED":
            print(f"  {point['name']}: finished earlier, not retrained ({' '.join(point['varies'])})", flush=True)
        else:
            todo.append((point, status))
    failed = _train_all(todo, config_path, base, home, at_once, threads, uri)
    return _report(uri, experiment, sweep_id, home, failed)


def _command(point: dict, status: str | None, config_path: str, base: Config, threads: int) -> list[str]:
    run_dir = (REPO_ROOT / base.training.runs_dir).resolve() / point["name"]
    cpu = [] if any(o.startswith("parallel.cpu_threads=") for o in point["overrides"]) else \
        [f"parallel.cpu_threads={threads}"]
    if status is not None and (run_dir / "config.yaml").exists():  # started before: continue it
        return [sys.executable, "-m", "pipeline", "train", "--resume", str(run_dir), *cpu]
    return [sys.executable, "-m", "pipeline", "train", "--config", str(config_path), *point["overrides"],
            f"training.run_name={point['name']}", f"tracking.sweep={point['name'].rsplit('-', 1)[0]}", *cpu]


def _train_all(todo, config_path, base: Config, home: Path, at_once: int, threads: int, uri: str) -> list[str]:
    """Run the points, `at_once` at a time; SIGTERM / SIGINT stop the running ones (they save and end KILLED)."""
    running: dict[str, subprocess.Popen] = {}
    failed, stopping = [], []

    def stop(signum, frame):
        if not stopping:
            stopping.append(signum)
            print(f"\n{signal.Signals(signum).name}: stopping the sweep's runs (they save a checkpoint); continue "
                  f"with the same command and --id {home.name}", file=sys.stderr, flush=True)
            for proc in running.values():
                proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, PYTHONPATH=str(REPO_ROOT))
    queue = list(todo)
    try:
        while (queue and not stopping) or running:
            while queue and not stopping and len(running) < at_once:
                point, status = queue.pop(0)
                verb = "resuming" if status is not None else "starting"
                print(f"  {point['name']}: {verb} ({' '.join(point['varies']) or 'base config'})", flush=True)
                with open(home / f"{point['name']}.log", "a") as log:
                    running[point["name"]] = subprocess.Popen(
                        _command(point, status, config_path, base, threads), cwd=REPO_ROOT, env=env, stdout=log,
                        stderr=subprocess.STDOUT, start_new_session=True)
            time.sleep(0.5)
            for name, proc in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                if proc.returncode == 0:
                    print(f"  {name}: finished", flush=True)
                elif not stopping:
                    failed.append(name)
                    print(f"  {name}: FAILED (exit {proc.returncode}); see {home / (name + '.log')}", flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopping:
        raise SystemExit(128 + stopping[0])
    return failed


def _report(uri: str, experiment: str, sweep_id: str, home: Path, failed: list[str]) -> int:
    rows, out_dir = comparison.compare(experiment, filter_string=f"tags.`pipeline.sweep` = '{sweep_id}'", uri=uri,
                                       out_dir=home / "report")
    print(comparison.table(rows))
    print(f"\nsweep {sweep_id}: {len(rows)} runs, best eval_loss first; {out_dir / 'runs.md'}, "
          f"{out_dir / 'loss_curves.png'}; the same with: make compare FILTER=\"tags.`pipeline.sweep` = "
          f"'{sweep_id}'\"", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}; fix and continue with --id {sweep_id}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(config: Config, args) -> int:
    return run(config, args.config or str(DEFAULT_CONFIG), args.overrides, args.id, args.parallel)
