"""`make promote MODEL=models:/<name>/<version> [ALIAS=champion] [METRIC=eval_loss] [FORCE=1]`: move a registry alias
(the deploy pointer a server follows, `models:/<name>@<alias>`) to a version only on evidence.

The version must have been evaluated (`make evaluate`) on the same held-out set as the alias's current holder, and
be at least as good there on METRIC (lower is better: eval_loss, perplexity; higher: task_accuracy, a fine-tuned
model's held-out task); otherwise the alias stays and the
refusal prints both numbers, or what to run. An unset alias takes any evaluated version. FORCE=1 moves it anyway.
Every move is recorded on the version's tags (`promotion.<alias>`: from which version, when, on what evidence).
"""
from __future__ import annotations

import json
import time

from core import tracking
from core.config import Config, ConfigError
from core.registry import parse_models_uri
from pipeline.runner.cli import config_argument, overrides_argument

HELP = "move a registry alias to a version if its evaluation is as good"


def arguments(p) -> None:
    config_argument(p)
    p.add_argument("--model", default="", help="models:/<name>/<version>")
    p.add_argument("--alias", default="champion")
    p.add_argument("--metric", default="eval_loss")
    p.add_argument("--force", action="store_true", help="move the alias even without or against the evidence")
    overrides_argument(p)

METRICS = ("eval_loss", "perplexity", "task_accuracy")
HIGHER_IS_BETTER = ("task_accuracy",)  # (a fine-tuned model's held-out task: make evaluate)


def run(config: Config, model: str, alias: str = "champion", metric: str = "eval_loss", force: bool = False) -> int:
    name, version, by_alias = parse_models_uri(model) if model else (None, None, None)
    if not name or by_alias or version in (None, "latest"):
        raise ConfigError("MODEL=models:/<name>/<version>: promote names the version to move the alias to")
    if metric not in METRICS:
        raise ConfigError(f"METRIC={metric}: one of {', '.join(METRICS)} (task_accuracy: higher is better; the "
                          "others lower)")
    if not alias.replace("-", "_").isidentifier():
        raise ConfigError(f"ALIAS={alias}: a plain name such as champion")
    client = tracking.client(tracking.tracking_uri(config.tracking))
    candidate = _version(client, name, version)
    holder = _holder(client, name, alias)
    evidence = judge(candidate, holder, alias, metric, force)
    client.set_registered_model_alias(name, alias, candidate.version)
    record = {"alias": alias, "from": str(holder.version) if holder else None, "at": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "forced": force, **evidence}
    client.set_model_version_tag(name, candidate.version, f"promotion.{alias}", json.dumps(record))
    before = f"from v{holder.version}" if holder else "(it was unset)"
    print(f"{name}@{alias} -> v{candidate.version} {before}: {evidence['reason']}", flush=True)
    return 0


def judge(candidate, holder, alias: str, metric: str, force: bool) -> dict:
    """The evidence for moving `alias` to `candidate` (ConfigError: refused, one line)."""
    mine = _evaluations(candidate, metric)
    if holder is None or str(holder.version) == str(candidate.version):
        if not mine and not force:
            raise ConfigError(f"v{candidate.version} has no evaluation: run make evaluate "
                              f"MODEL=models:/{candidate.name}/{candidate.version} first (or FORCE=1)")
        return {"reason": "no holder to compare with" if holder is None else "already the holder",
                "dataset": candidate.tags.get("eval.dataset"), metric: mine.get(candidate.tags.get("eval.dataset"))}
    theirs = _evaluations(holder, metric)
    shared = [d for d in (holder.tags.get("eval.dataset"), *theirs) if d in mine and d in theirs]
    if not shared:
        if force:
            return {"reason": "forced (no evaluation on a shared held-out set)", "dataset": None}
        where = holder.tags.get("eval.dataset")
        raise ConfigError(
            f"no evaluation of v{candidate.version} and v{holder.version} ({alias}) on the same held-out set: run "
            f"make evaluate MODEL=models:/{candidate.name}/{candidate.version}"
            + (f" on the set v{holder.version} was evaluated on ({where})" if where else
               f" and MODEL=models:/{holder.name}/{holder.version}") + " (or FORCE=1)")
    dataset = shared[0]
    new, old = mine[dataset], theirs[dataset]
    evidence = {"dataset": dataset, "metric": metric, "new": new, "old": old}
    better, worse = (">=", "<") if metric in HIGHER_IS_BETTER else ("<=", ">")
    if new >= old if metric in HIGHER_IS_BETTER else new <= old:
        return {**evidence, "reason": f"{metric} {new:.4f} {better} {old:.4f} on held-out set {dataset}"}
    if force:
        return {**evidence, "reason": f"forced: {metric} {new:.4f} {worse} {old:.4f} on held-out set {dataset}"}
    raise ConfigError(f"v{candidate.version} is worse than v{holder.version} ({alias}) on held-out set {dataset}: "
                      f"{metric} {new:.4f} {worse} {old:.4f}; the alias stays (FORCE=1 moves it anyway)")


def _evaluations(version, metric: str) -> dict[str, float]:
    """{held-out set digest: metric} from the version's tags (`eval.<set>.<metric>`, written by make evaluate)."""
    out = {}
    for key, value in version.tags.items():
        parts = key.split(".")
        if len(parts) == 3 and parts[0] == "eval" and parts[2] == metric:
            out[parts[1]] = float(value)
    return out


def _version(client, name: str, version: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version(name, version)
    except MlflowException:
        raise ConfigError(f"models:/{name}/{version} is not in the registry") from None


def _holder(client, name: str, alias: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def main(config: Config, args) -> int:
    return run(config, args.model, args.alias, args.metric, args.force)
