"""The runs of an experiment side by side (terminal table, Markdown, CSV) and their loss curves (PNG): `make compare`
prints them, `make sweep` ends with them.

Reads MLflow only, through the client, so it works the same on the local store and on a tracking server.
"""
from __future__ import annotations

import csv
from pathlib import Path

from core import REPO_ROOT, tracking
from core.config import ConfigError
from training.metrics.loss_plot import history as _history, plot_curves

COLUMNS = ["run", "run_id", "status", "layout", "dp", "tp", "pp", "sharding", "hidden", "layers", "lr", "batch",
           "steps", "final_loss", "best_eval_loss", "best_perplexity", "tokens_per_s", "wall_s", "model_version"]


def summarize(client, run, metric: str) -> dict:
    params, tags, run_id = run.data.params, run.data.tags, run.info.run_id
    losses = _history(client, run_id, "loss")
    evals = _history(client, run_id, metric)
    best = min((v for _, v in evals), default=None)
    speeds = [v for _, v in _history(client, run_id, "tokens_per_second")]
    end = run.info.end_time or run.info.start_time
    return {
        "run": run.info.run_name, "run_id": run_id, "status": run.info.status,
        "layout": tags.get(tracking.TAG_LAYOUT, "?"), "dp": params.get("layout.dp", "?"),
        "tp": params.get("layout.tp", "?"), "pp": params.get("layout.pp", "?"),
        "sharding": params.get("layout.sharding_degree", "?"), "hidden": params.get("model.hidden_size", "?"),
        "layers": params.get("model.num_layers", "?"), "lr": params.get("training.learning_rate", "?"),
        "batch": params.get("training.global_batch_size", "?"), "steps": params.get("training.max_steps", "?"),
        "final_loss": round(losses[-1][1], 4) if losses else None,
        "best_eval_loss": round(best, 4) if best is not None else None,
        "best_perplexity": round(tracking.perplexity(best), 2) if best is not None and metric == "eval_loss" else None,
        "tokens_per_s": round(sum(speeds) / len(speeds), 1) if speeds else None,
        "wall_s": round((end - run.info.start_time) / 1000, 1) if end else None,
        "model_version": tags.get("exported_versions", ""),
        "_losses": losses, "_evals": evals,
    }


def compare(experiment: str, metric: str = "eval_loss", filter_string: str = "", uri: str | None = None,
            out_dir: Path | None = None) -> tuple[list[dict], Path]:
    uri = uri or tracking.tracking_uri()
    tracking.check_reachable(uri)
    client = tracking.client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ConfigError(f"EXPERIMENT={experiment}: no such MLflow experiment")
    runs = client.search_runs([exp.experiment_id], filter_string, max_results=1000)
    rows = [summarize(client, run, metric) for run in runs if run.data.tags.get("pipeline.stage") == "train"]
    rows.sort(key=lambda r: (r["best_eval_loss"] is None, r["best_eval_loss"] or 0.0))
    out_dir = out_dir or REPO_ROOT / "reports" / "compare" / experiment
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out_dir / "runs.csv")
    (out_dir / "runs.md").write_text(markdown(rows, experiment, metric))
    plot_curves(rows, out_dir / "loss_curves.png", f"{experiment}: train and eval loss")
    return rows, out_dir


def _cell(value) -> str:
    return "" if value is None else str(value)


def markdown(rows: list[dict], experiment: str, metric: str) -> str:
    lines = [f"# Experiment `{experiment}`: {len(rows)} runs, best {metric} first", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def table(rows: list[dict]) -> str:
    shown = [c for c in COLUMNS if c != "run_id"]
    widths = {c: max(len(c), *(len(_cell(r[c])) for r in rows)) if rows else len(c) for c in shown}
    head = "  ".join(c.ljust(widths[c]) for c in shown)
    return "\n".join([head, "-" * len(head)] + ["  ".join(_cell(r[c]).ljust(widths[c]) for c in shown)
                                                  for r in rows])


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
