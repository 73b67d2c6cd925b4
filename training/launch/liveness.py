"""Which MLflow runs are really running, and marking the dead ones (`make runs`, and every `make train`
before it starts: training/launch/tracked_run.py).

A run whose launcher was killed with SIGKILL, or whose node was lost, cannot close its MLflow run: it would stay
RUNNING forever. Each launcher therefore tags its run with who it is (`pipeline.launcher` = host:pid:start time) and
stamps `pipeline.heartbeat` every `tracking.heartbeat_s`. A RUNNING run is
  - dead   when its launcher was on this host and that process no longer exists (pid and start time checked),
  - stale  when its heartbeat is older than `tracking.stale_after_s` (any host: a lost node stops beating),
  - alive  otherwise.
Reaping marks dead and stale runs FAILED with a `pipeline.reaped` tag saying why; `make train RESUME=` still
continues them. Every `make train` reaps its own experiment before it starts.
"""
from __future__ import annotations

import os
import socket
import time

from core import tracking
from core.processes import proc_stat


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), or None if it is gone."""
    fields = proc_stat(pid)
    return fields[19] if fields else None


def launcher_id(pid: int | None = None) -> str:
    pid = pid or os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


def liveness(tags: dict, now: float, stale_after_s: float, host: str | None = None) -> tuple[str, str]:
    """('alive' | 'dead' | 'stale', why) for a RUNNING run's tags."""
    host = host or socket.gethostname()
    launcher = tags.get(tracking.TAG_LAUNCHER, "")
    parts = launcher.rsplit(":", 2)
    if len(parts) == 3 and parts[0] == host and parts[1].isdigit():
        if _start_time(int(parts[1])) != parts[2]:
            return "dead", f"launcher process {parts[1]} on {host} is gone"
    beat = tags.get(tracking.TAG_HEARTBEAT)
    if beat is None:
        return "alive", "no heartbeat recorded (started by an older version?)"
    age = now - float(beat)
    if age > stale_after_s:
        return "stale", f"no heartbeat for {age:.0f}s (> tracking.stale_after_s={stale_after_s:g})"
    return "alive", f"heartbeat {age:.0f}s ago"


def running(mlflow_client, experiment: str, stale_after_s: float) -> list[tuple[object, str, str]]:
    """(run, state, why) for every RUNNING run of the experiment."""
    exp = mlflow_client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    now = time.time()
    return [(run, *liveness(run.data.tags, now, stale_after_s))
            for run in mlflow_client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'")]


def reap(mlflow_client, experiment: str, stale_after_s: float) -> list[str]:
    """Mark dead and stale runs FAILED; returns a line per run marked."""
    marked = []
    for run, state, why in running(mlflow_client, experiment, stale_after_s):
        if state == "alive":
            continue
        mlflow_client.set_tag(run.info.run_id, "pipeline.reaped", f"{state}: {why}")
        mlflow_client.set_terminated(run.info.run_id, "FAILED")
        marked.append(f"{run.info.run_name} ({run.info.run_id}): {state}, {why}")
    return marked
