"""`make compare`: the runs of an experiment side by side (terminal table, Markdown, CSV) and their loss curves (PNG),
from MLflow's client alone (pipeline/runner/comparison.py), so the local store and a tracking server read the same."""
from __future__ import annotations

from pathlib import Path

from core.config import Config
from pipeline.runner.comparison import compare, table
from pipeline.runner.cli import config_argument

HELP = "compare the runs of an experiment (table, Markdown, CSV, PNG)"


def arguments(p) -> None:
    config_argument(p, "; names the default experiment")
    p.add_argument("--experiment", default="")
    p.add_argument("--metric", default="eval_loss")
    p.add_argument("--filter", default="", help="MLflow search filter, e.g. \"params.layout.tp = '2'\"")
    p.add_argument("--out", default="", help="output directory (default reports/compare/<experiment>)")


def run(experiment: str, metric: str, filter_string: str, out_dir: Path | None = None) -> int:
    rows, out_dir = compare(experiment, metric, filter_string, out_dir=out_dir)
    print(table(rows))
    print(f"\n{len(rows)} runs of {experiment!r} sorted by best {metric}; written: {out_dir / 'runs.md'}, "
          f"{out_dir / 'runs.csv'}, {out_dir / 'loss_curves.png'}")
    return 0


def main(config: Config, args) -> int:
    return run(args.experiment or config.tracking.experiment, args.metric, args.filter,
               Path(args.out) if args.out else None)
