"""Loss-curve plots (train and eval loss by step) of MLflow runs: one run's, attached when it finishes
(training/launch/tracked_run.py), and an experiment's side by side (`make compare`)."""
from __future__ import annotations

from pathlib import Path

from core import tracking


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return list(tracking.metric_history(client, run_id, key).items())


def plot_curves(rows: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row in rows:
        label = f"{row['run']} ({row['layout']})"
        if row["_losses"]:
            train_ax.plot(*zip(*row["_losses"]), label=label)
        if row["_evals"]:
            eval_ax.plot(*zip(*row["_evals"]), marker="o", label=label)
    for ax, name in ((train_ax, "train loss"), (eval_ax, "eval loss")):
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run_losses(client, run_id: str, path: Path) -> Path:
    """The loss-curve PNG each training run logs as an artifact when it finishes."""
    run = client.get_run(run_id)
    row = {"run": run.info.run_name, "layout": run.data.tags.get(tracking.TAG_LAYOUT, "?"),
           "_losses": history(client, run_id, "loss"), "_evals": history(client, run_id, "eval_loss")}
    return plot_curves([row], path, f"{run.info.run_name}: loss curves")
