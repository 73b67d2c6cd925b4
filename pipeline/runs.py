"""`make runs [REAP=1]`: the RUNNING runs of an experiment, alive, dead or stale (training/launch/liveness.py
says which and why); `--reap` marks the dead and stale ones FAILED."""
from __future__ import annotations

from core import tracking
from core.config import Config
from training.launch.liveness import reap, running
from pipeline.runner.cli import config_argument

HELP = "RUNNING runs of an experiment: alive, dead or stale; --reap marks the dead and stale ones FAILED"


def arguments(p) -> None:
    config_argument(p, "; names the experiment")
    p.add_argument("--experiment", default="")
    p.add_argument("--reap", action="store_true")


def main(config: Config, args) -> int:
    experiment, stale_after_s = args.experiment or config.tracking.experiment, config.tracking.stale_after_s
    client = tracking.client(tracking.tracking_uri(config.tracking))
    found = running(client, experiment, stale_after_s)
    print(f"{len(found)} RUNNING run(s) in experiment {experiment!r}")
    for run, state, why in found:
        print(f"  {state:5}  {run.info.run_name}  {run.info.run_id}  {why}")
    if args.reap:
        for line in reap(client, experiment, stale_after_s):
            print(f"marked FAILED: {line}")
    return 0
