"""`make doctor`: what this machine can run, in a few lines (training/launch/machine.py): the Paddle build, the CUDA
libraries it opens, cuDNN, NCCL, the driver and GPUs, and the config's layout against the devices; each problem is one
line that names its fix, and the exit code is 1 when there is one."""
from __future__ import annotations

from core.config import Config
from training.launch.machine import checks
from pipeline.runner.cli import config_argument, overrides_argument

HELP = "what this machine can run: Paddle's build, CUDA libraries, driver, GPUs"


def arguments(p) -> None:
    config_argument(p, "; its layout is checked against the devices")
    overrides_argument(p)


def run(config: Config) -> int:
    found = checks(config)
    for check in found:
        print(check.line(), flush=True)
    problems = [c for c in found if not c.ok]
    print(f"{len(problems)} problem(s)" if problems else "ready", flush=True)
    return 1 if problems else 0


def main(config: Config, args) -> int:
    return run(config)
