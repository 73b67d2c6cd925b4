"""`python -m pipeline <stage> [options] [section.key=value ...]` -- the one CLI the Makefile calls."""
from __future__ import annotations

import argparse
import sys

import pipeline  # noqa: F401  (zlib before paddle)
from pipeline import REPO_ROOT
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
    export.add_argument("overrides", nargs="*", help="section.key=value on top of the source run's config, "
                                                     "e.g. export.exports_dir=/data/exports")

    serve = sub.add_parser("serve", help="start the Paddle Serving endpoint in the background")
    serve.add_argument("--config", default=None, help="config with the serving section (default tiny.yaml)")
    serve.add_argument("--model", default="", help="export directory, models:/<name>/<version>, models:/<name>@<alias> "
                                                    "or models:/<name>/latest (default: the newest registered version)")
    serve.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. serving.http_port=18280")
    for verb, text in (("stop", "stop the running endpoint (whole process group)"),
                       ("smoke", "real HTTP/gRPC calls against the running endpoint")):
        p = sub.add_parser(verb, help=text)
        p.add_argument("--config", default=None)
        p.add_argument("overrides", nargs="*")

    compare = sub.add_parser("compare", help="compare the runs of an experiment (table, Markdown, CSV, PNG)")
    compare.add_argument("--config", default=None, help="config naming the default experiment (default tiny.yaml)")
    compare.add_argument("--experiment", default="")
    compare.add_argument("--metric", default="eval_loss")
    compare.add_argument("--filter", default="", help="MLflow search filter, e.g. \"params.layout.tp = '2'\"")
    bench = sub.add_parser("bench", help="benchmark suite (reports/bench/bench.{json,md}, MLflow experiment bench)")
    bench.add_argument("--quick", action="store_true", help="tiny settings: checks the harness, not the machine")
    bench.add_argument("--out", default="", help="output directory (default reports/bench)")
    runs = sub.add_parser("runs", help="RUNNING runs of an experiment: alive, dead or stale; --reap marks the "
                                       "dead and stale ones FAILED")
    runs.add_argument("--config", default=None, help="config naming the experiment (default tiny.yaml)")
    runs.add_argument("--experiment", default="")
    runs.add_argument("--reap", action="store_true")
    sub.add_parser("mlflow-server", help="start a tracking server on 127.0.0.1 (settings: mlflow/server.env)")
    sub.add_parser("mlflow-stop", help="stop the tracking server")

    args = parser.parse_args(argv)
    try:
        if args.stage == "train":
            from pipeline import train as train_stage

            train_stage.stop_signal_handler()
            return train_stage.run(args.config, args.overrides, resume=args.resume, dry_run=args.dry_run)
        if args.stage == "export":
            from training import export as export_stage

            export_stage.run(args.experiment, args.metric, args.run_id, args.config, args.overrides)
        if args.stage == "compare":
            from pipeline import compare as compare_stage
            from pipeline.config import load_config

            base = load_config(args.config or REPO_ROOT / "configs" / "tiny.yaml")
            return compare_stage.run(args.experiment or base.tracking.experiment, args.metric, args.filter)
        if args.stage == "runs":
            from pipeline import runs as runs_stage, tracking
            from pipeline.config import load_config

            base = load_config(args.config or REPO_ROOT / "configs" / "tiny.yaml")
            return runs_stage.main(args.experiment or base.tracking.experiment, base.tracking.stale_after_s,
                                   tracking.tracking_uri(base), args.reap)
        if args.stage == "bench":
            from pipeline import bench as bench_stage

            bench_stage.run(quick=args.quick, out=args.out or None)
            return 0
        if args.stage in ("mlflow-server", "mlflow-stop"):
            from pipeline import mlflow_server

            return mlflow_server.main(args.stage)
        if args.stage in ("serve", "stop", "smoke"):
            return _serving(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before training started (data preparation, MLflow set-up): nothing was kept
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def _serving(args) -> int:

    from pipeline import REPO_ROOT, tracking
    from pipeline.config import load_config
    from serving import server

    config = load_config(args.config or REPO_ROOT / "configs" / "tiny.yaml", args.overrides)
    state_dir = server.default_state_dir(config)
    if args.stage == "serve":
        from pipeline import models

        state = server.start(config, models.resolve(config, args.model), state_dir)
        print(f"serving {state['model_dir']} (ready in {state['ready_after_s']}s, pid {state['pid']})\n"
              f"HTTP: {state['http_url']}\ngRPC: {state['rpc_address']}\nlogs: {state_dir}")
        return 0
    if args.stage == "stop":
        print("stopped" if server.stop(state_dir) else "no server was running")
        return 0
    state = server.read_state(state_dir)
    if not state:
        raise ConfigError("no running server; start it with `make serve`")
    from serving.smoke import run_smoke

    failures = run_smoke(state, tracking.client(tracking.tracking_uri(config)))
    print("SMOKE", "PASS" if not failures else f"FAIL ({len(failures)} checks)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
