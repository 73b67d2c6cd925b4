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

    args = parser.parse_args(argv)
    try:
        if args.stage == "train":
            from pipeline import train as train_stage

            train_stage.stop_signal_handler()
            return train_stage.run(args.config, args.overrides, resume=args.resume, dry_run=args.dry_run)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
