"""`make train`: a training run from a config (training/launch/train_run.py: resolve -> prepare -> open -> launch ->
close), or `--resume` of one by its run directory or MLflow run id; `--dry-run` prints the layout and stops."""
from __future__ import annotations

from core.config import Config
from training.launch import supervise, train_run
from pipeline.runner.cli import config_argument, overrides_argument

HELP = "train a model (hybrid parallel when the layout asks for it)"


def arguments(p) -> None:
    config_argument(p)
    p.add_argument("--resume", default="", help="run directory or MLflow run id to continue")
    p.add_argument("--dry-run", action="store_true", help="print the parallel layout and exit")
    overrides_argument(p, "section.key=value overrides, e.g. training.max_steps=40")


def main(config: Config, args) -> int:
    supervise.stop_signal_handler()  # (until the ranks start, SIGTERM removes what was half-made)
    return train_run.run(config, resume=args.resume, dry_run=args.dry_run)
