"""`python -m pipeline <verb> [options] [section.key=value ...]` -- the one CLI the Makefile calls.

Each verb is one module of pipeline/ named after it (`VERBS`: data, train, finetune, export, serve, stop, smoke, reload, compare,
sweep, runs, plan, doctor, evaluate, promote, generate, mlflow-server, mlflow-stop, object-store,
object-store-stop), whose `main(config, args)` is
handed the config, loaded once (`verb_config`), and the parsed arguments. What the verbs share to run training,
servers and MLflow runs is in pipeline/runner/.
The benchmark suite has its own entry point: `python -m bench` (bench/).
"""
from __future__ import annotations

import argparse
import sys

import core  # noqa: F401  (zlib before paddle)
from core.config import DEFAULT_CONFIG, Config, ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run_verb(args.verb, verb_config(args), args) or 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before training started (data preparation, MLflow set-up): nothing was kept
        print("interrupted", file=sys.stderr)
        return 130


def verb_config(args) -> Config:
    """The config every verb is handed, loaded once: `--config` (default configs/tiny.yaml) with the overrides on top;
    for `train --resume`, the run directory's recorded config with the overrides on top. Export and sweep get the
    file alone: export applies its overrides to the source run's config, sweep's are a grid."""
    if getattr(args, "resume", ""):
        from pipeline import train

        return train.resumed_config(args.resume, args.overrides)
    own_overrides = args.verb in ("export", "sweep")
    return load_config(getattr(args, "config", None) or DEFAULT_CONFIG,
                       [] if own_overrides else getattr(args, "overrides", []))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline", description="PaddlePaddle train-to-serve pipeline")
    sub = p.add_subparsers(dest="verb", required=True)
    config_help = f"YAML config (default {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parent.parent)})"

    train = sub.add_parser("train", help="train a model (hybrid parallel when the layout asks for it)")
    train.add_argument("--config", default=None, help=config_help)
    train.add_argument("--resume", default="", help="run directory or MLflow run id to continue")
    train.add_argument("--dry-run", action="store_true", help="print the parallel layout and exit")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. training.max_steps=40")

    add_finetune_verb(sub)
    add_export_and_serve_verbs(sub, config_help)

    compare = sub.add_parser("compare", help="compare the runs of an experiment (table, Markdown, CSV, PNG)")
    compare.add_argument("--config", default=None, help=config_help + "; names the default experiment")
    compare.add_argument("--experiment", default="")
    compare.add_argument("--metric", default="eval_loss")
    compare.add_argument("--filter", default="", help="MLflow search filter, e.g. \"params.layout.tp = '2'\"")
    compare.add_argument("--out", default="", help="output directory (default reports/compare/<experiment>)")
    sweep = sub.add_parser("sweep", help="train a grid of overrides (key=v1,v2 ...), N at a time, then compare them")
    sweep.add_argument("--config", default=None, help=config_help)
    sweep.add_argument("--id", default="", help="continue this sweep (finished runs are not retrained)")
    sweep.add_argument("--parallel", type=int, default=0, help="runs at once (default: what the cores hold)")
    sweep.add_argument("overrides", nargs="*", help="e.g. training.learning_rate=1e-3,3e-3 model.num_layers=2,4")
    runs = sub.add_parser("runs", help="RUNNING runs of an experiment: alive, dead or stale; --reap marks the "
                                       "dead and stale ones FAILED")
    runs.add_argument("--config", default=None, help=config_help + "; names the experiment")
    runs.add_argument("--experiment", default="")
    runs.add_argument("--reap", action="store_true")
    plan = sub.add_parser("plan", help="memory and step-time estimates of every layout of a model on a cluster")
    plan.add_argument("--config", default=None, help=config_help)
    plan.add_argument("--top", type=int, default=10, help="how many fitting layouts to print")
    plan.add_argument("--csv", default="", help="write every valid layout, ranked, to this CSV file")
    plan.add_argument("--write", default="", help="write the top layout as a config file (check it with DRY_RUN=1)")
    plan.add_argument("overrides", nargs="*", help="e.g. cluster.gpus=512 cluster.gpu_memory_gb=80")
    add_lifecycle_verbs(sub, config_help)
    add_service_verbs(sub)
    return p


def add_export_and_serve_verbs(sub, config_help: str) -> None:
    export = sub.add_parser("export", help="best checkpoint -> static graph, parity-checked, registered in MLflow")
    export.add_argument("--config", default=None, help=config_help + "; names the experiment to pick from")
    export.add_argument("--experiment", default="", help="MLflow experiment to pick the best run from")
    export.add_argument("--metric", default="", help="eval metric to minimise (default export.metric)")
    export.add_argument("--run-id", default="", help="export this run (latest: the newest finished one) instead of "
                                                     "the best one")
    export.add_argument("overrides", nargs="*", help="section.key=value on top of the source run's config, "
                                                     "e.g. export.exports_dir=/data/exports")

    serve = sub.add_parser("serve", help="start the Paddle Serving endpoint in the background")
    serve.add_argument("--config", default=None, help=config_help)
    serve.add_argument("--model", default="", help="export directory, models:/<name>/<version>, models:/<name>@<alias> "
                                                    "or models:/<name>/latest (default: the newest registered version)")
    serve.add_argument("--foreground", action="store_true", help="run the server as this process (containers, "
                                                                 "supervisors): its exit code, its signals")
    serve.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. serving.http_port=18280")
    for verb, text in (("stop", "drain and stop the running endpoint (SIGTERM, then its whole process group)"),
                       ("smoke", "real HTTP/gRPC calls against the running endpoint"),
                       ("reload", "the running endpoint resolves its models:/ reference again and switches if it "
                                  "moved")):
        v = sub.add_parser(verb, help=text)
        v.add_argument("--config", default=None, help=config_help)
        v.add_argument("overrides", nargs="*")


def add_finetune_verb(sub) -> None:
    finetune = sub.add_parser("finetune", help="supervised fine-tuning (LoRA or full) of a trained model on "
                                               "instruction data with the chat template")
    finetune.add_argument("--config", default=None, help="YAML config (make finetune: configs/tiny-chat.yaml)")
    finetune.add_argument("--model", default="", help="the base: an MLflow run id, a checkpoint directory or "
                                                      "models:/<name>/<version|@alias> (default: the best run of "
                                                      "finetune.base_experiment)")
    finetune.add_argument("--data", default="", help="reviews (the built-in task) or a .jsonl of {src, tgt} or "
                                                     "{messages}")
    finetune.add_argument("--resume", default="", help="run directory or MLflow run id of a fine-tuning run")
    finetune.add_argument("--dry-run", action="store_true", help="print the layout and exit")
    finetune.add_argument("overrides", nargs="*", help="section.key=value, e.g. finetune.method=full")


def add_service_verbs(sub) -> None:
    """The local services the pipeline can use: an MLflow tracking server and an S3 endpoint."""
    for verb, text in (("mlflow-server", "start a tracking server on 127.0.0.1 (settings: mlflow/server.env)"),
                       ("mlflow-stop", "stop the tracking server"),
                       ("object-store", "a local S3 endpoint (SeaweedFS) for storage.uri, on 127.0.0.1:8333"),
                       ("object-store-stop", "stop the local S3 endpoint (its data is kept)")):
        sub.add_parser(verb, help=text)
    add_gateway_verbs(sub)


def add_gateway_verbs(sub) -> None:
    """The gateway's verbs (docs/gateway.md): each takes the config and overrides `make gateway` takes."""
    verbs = {"gateway": "nginx in front of the serving replicas: keys, limits, usage, split, failover",
             "gateway-stop": "stop the gateway (keys and logs are kept)",
             "gateway-key": "a consumer's key (printed once) with its limits, or REVOKE one",
             "gateway-usage": "requests, tokens and 429s per consumer through the gateway"}
    for verb, text in verbs.items():
        p = sub.add_parser(verb, help=text)
        p.add_argument("--config", default=None)
        if verb == "gateway-key":
            p.add_argument("--name", default="")
            p.add_argument("--rpm", type=int, default=None, help="requests per minute")
            p.add_argument("--tpm", type=int, default=0, help="tokens per minute (0 = no budget)")
            p.add_argument("--revoke", default="", help="a consumer whose key is refused from now on")
        p.add_argument("overrides", nargs="*", help="section.key=value, e.g. gateway.port=18190")


def add_lifecycle_verbs(sub, config_help: str) -> None:
    """The verbs around training and serving: data before, evaluate and promote after, doctor for the machine."""
    data = sub.add_parser("data", help="prepare the corpus as token shards (reused when already prepared)")
    data.add_argument("--config", default=None, help=config_help)
    data.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. data.workers=4 data.engine=ray")
    evaluate = sub.add_parser("evaluate", help="a registered version on a fixed held-out set and prompt set, in MLflow")
    evaluate.add_argument("--config", default=None, help=config_help)
    evaluate.add_argument("--model", default="", help="models:/<name>/<version>, models:/<name>@<alias> or a directory")
    evaluate.add_argument("--data", default="", help="a corpus (file, glob or directory) instead of the source run's "
                                                     "validation split")
    evaluate.add_argument("overrides", nargs="*")
    promote = sub.add_parser("promote", help="move a registry alias to a version if its evaluation is as good")
    promote.add_argument("--config", default=None, help=config_help)
    promote.add_argument("--model", default="", help="models:/<name>/<version>")
    promote.add_argument("--alias", default="champion")
    promote.add_argument("--metric", default="eval_loss")
    promote.add_argument("--force", action="store_true", help="move the alias even without or against the evidence")
    promote.add_argument("overrides", nargs="*")
    add_generate_verb(sub, config_help)
    doctor = sub.add_parser("doctor", help="what this machine can run: Paddle's build, CUDA libraries, driver, GPUs")
    doctor.add_argument("--config", default=None, help=config_help + "; its layout is checked against the devices")
    doctor.add_argument("overrides", nargs="*")


def add_generate_verb(sub, config_help: str) -> None:
    generate = sub.add_parser("generate", help="batch generation over a table (jsonl/parquet), resumable")
    generate.add_argument("--config", default=None, help=config_help)
    generate.add_argument("--model", default="", help="as for serve (default: the newest registered version)")
    generate.add_argument("--input", default="", help="prompts: .jsonl or .parquet with `prompt` (and `id`, settings)")
    generate.add_argument("--output", default="", help=".jsonl or .parquet; rows already there are not generated again")
    generate.add_argument("--engine", default="local", help="local (one worker process per core) or ray (Ray Data)")
    generate.add_argument("--workers", type=int, default=0, help="worker processes / Ray actors (0 = one per core)")
    generate.add_argument("--ray-address", default="", help="a Ray cluster (default: a local instance)")
    generate.add_argument("overrides", nargs="*")


# verb -> its module in pipeline/ (each has `main(config, args) -> int`); the run machinery the verbs share is in
# pipeline/runner/, never a verb
VERBS = {verb: verb.replace("-", "_") for verb in (
    "data", "train", "finetune", "export", "serve", "stop", "smoke", "reload", "compare", "sweep", "runs", "plan", "doctor",
    "evaluate", "promote", "generate", "mlflow-server", "mlflow-stop", "object-store", "object-store-stop", "gateway",
    "gateway-stop", "gateway-key", "gateway-usage")}


def run_verb(verb: str, config: Config, args) -> int:
    import importlib

    return importlib.import_module(f"pipeline.{VERBS[verb]}").main(config, args)


if __name__ == "__main__":
    sys.exit(main())
