"""`python -m pipeline <verb> [options] [section.key=value ...]` -- the one CLI the Makefile calls.

Each verb is one module of pipeline/ named after it (`VERBS`), which declares its help line (HELP) and its arguments
(`arguments(parser)`) beside its `main(config, args)`; main is handed the config, loaded once (`verb_config`), and the
parsed arguments. A training run's launcher is training/launch/; what the verbs share that belongs to no stage (their
arguments, the servers of MLflow, S3 and VisualDL, the run a verb starts from) is in pipeline/runner/; no verb imports
another (tests/unit/test_layers.py). The benchmark suite has its own entry point: `python -m bench` (bench/).
"""
from __future__ import annotations

import argparse
import importlib
import sys

import core  # noqa: F401  (zlib before paddle)
from core.config import DEFAULT_CONFIG, Config, ConfigError, load_config
from pipeline.runner import cli

# verb -> its module in pipeline/; what the verbs share is in pipeline/runner/, never a verb
VERBS = {verb: verb.replace("-", "_") for verb in (
    "data", "tokenizer", "train", "finetune", "export", "serve", "stop", "smoke", "reload", "compare", "sweep", "runs", "plan",
    "doctor", "evaluate", "promote", "generate", "mlflow-server", "mlflow-stop", "object-store", "object-store-stop",
    "gateway", "gateway-stop", "gateway-key", "gateway-usage", "visualdl", "visualdl-stop")}


def main(argv: list[str] | None = None) -> int:
    try:
        args, config = parse(sys.argv[1:] if argv is None else argv)
        return run_verb(args.verb, config, args) or 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before training started (data preparation, MLflow set-up): nothing was kept
        print("interrupted", file=sys.stderr)
        return 130


def parse(argv: list[str]) -> tuple[argparse.Namespace, Config]:
    """A command line (the Makefile's `--args "$ARGS"` included) -> its verb's arguments and config; nothing runs.
    tests/unit/test_documented_commands.py sends every documented `make` command through it."""
    given = cli.words(argv)
    verb = next((a for a in given if not a.startswith("-")), None)
    args = parser(verb if verb in VERBS else None).parse_args(given)
    return args, verb_config(args)


def verb_config(args) -> Config:
    """The config every verb is handed, loaded once: `--config` (default configs/tiny.yaml) with the overrides on top;
    for `--resume`, the run directory's recorded config with the overrides on top. A verb whose module says
    OWN_OVERRIDES (export, sweep) gets the file alone: export applies its overrides to the source run's config, sweep's
    are a grid."""
    if getattr(args, "resume", ""):
        from training.launch import train_run

        return train_run.resumed_config(args.resume, args.overrides)
    own_overrides = getattr(module_of(args.verb), "OWN_OVERRIDES", False)
    return load_config(getattr(args, "config", None) or DEFAULT_CONFIG,
                       [] if own_overrides else getattr(args, "overrides", []))


def module_of(verb: str):
    return importlib.import_module(f"pipeline.{VERBS[verb]}")


def parser(verb: str | None = None) -> argparse.ArgumentParser:
    """Every verb with its module's HELP and `arguments`; given `verb`, only that one's module is imported (the
    others are listed by name: `python -m pipeline --help` imports them all)."""
    p = argparse.ArgumentParser(prog="python -m pipeline", description="PaddlePaddle train-to-serve pipeline")
    sub = p.add_subparsers(dest="verb", required=True)
    for name in VERBS:
        if verb not in (None, name):
            sub.add_parser(name)
            continue
        module = module_of(name)
        verb_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        if hasattr(module, "arguments"):
            module.arguments(verb_parser)
    return p


def run_verb(verb: str, config: Config, args) -> int:
    return module_of(verb).main(config, args)


if __name__ == "__main__":
    sys.exit(main())
