"""`make visualdl [RUN=<run or experiment>]`: VisualDL's dashboard over a run's logs (runs/<run>/visualdl/: its
numbers and each pipeline stage's times), or an MLflow experiment's runs side by side; on visualdl.host:visualdl.port
(loopback by default), in the background until `make visualdl-stop` (pipeline/runner/visualdl_server.py)."""
from __future__ import annotations

from core.config import Config
from pipeline.runner import visualdl_server
from pipeline.runner.cli import config_argument, overrides_argument

HELP = "VisualDL's dashboard over a run's logs, or an experiment's runs side by side"


def arguments(p) -> None:
    config_argument(p)
    p.add_argument("--run", default="", help="a run directory or name, or an MLflow experiment (default: the newest "
                                              "run with logs)")
    overrides_argument(p, "section.key=value, e.g. visualdl.port=18041")


def main(config: Config, args) -> int:
    state = visualdl_server.start(config, args.run)
    print(f"VisualDL: {state['url']}/app/scalar (pid {state['pid']}), showing {state['showing']} from "
          f"{state['logdir']}; stop it with make visualdl-stop", flush=True)
    return 0
