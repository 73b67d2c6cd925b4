"""`python -m pipeline <stage> [options] [section.key=value ...]` -- the one CLI the Makefile calls."""
from __future__ import annotations

import argparse
import sys

import pipeline  # noqa: F401  (zlib before paddle)
from pipeline.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description="PaddlePaddle train-to-serve pipeline")
    sub = parser.add_subparsers(dest="stage", required=True)

    train = sub.add_parser("train", help="train a model (hybrid parallel when the layout asks for it)")
    train.add_argument("--config", default=None, help="YAML file in configs/ (default: built-in defaults)")
    train.add_argument("--resume", default="", help="run directory or MLflow run id to continue")
    train.add_argument("--dry-run", action="store_true", help="print the parallel layout and exit")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. training.max_steps=40")

    export = sub.add_parser("export", help="best checkpoint -> static graph, parity-checked, registered in MLflow")
    export.add_argument("--config", default=None, help="config naming the default experiment (default tiny.yaml)")
    export.add_argument("--experiment", default="", help="MLflow experiment to pick the best run from")
    export.add_argument("--metric", default="", help="eval metric to minimise (default export.metric)")
    export.add_argument("--run-id", default="", help="export this run instead of the best one")

    args = parser.parse_args(argv)
    try:
        if args.stage == "train":
            from pipeline import train as train_stage

            train_stage.stop_signal_handler()
            return train_stage.run(args.config, args.overrides, resume=args.resume, dry_run=args.dry_run)
        if args.stage == "export":
            from training import export as export_stage

            export_stage.run(args.experiment, args.metric, args.run_id, args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
