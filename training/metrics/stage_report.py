"""The end of a pipeline run: per-stage times, the measured timeline next to the schedule's bubble, balancing advice.

Reads the ranks' `pipeline_parallel/rank<r>.json` (training/metrics/stage_timing.py), draws the timeline from the order Paddle's
engine reported for each stage, placed with the measured per-micro-batch forward/backward times of that stage
(core/schedules.py), logs it as `pipeline_parallel/timeline.png` + `pipeline_parallel/stages.json` and the per-stage metrics to
MLflow, and says which stage is the bottleneck and which `parallel.stage_layers` would even the stages out.

The advice: a stage's forward splits into its decoder layers (timed by hooks) and the rest (embedding on the first
stage; norm, LM head and loss on the last); the backward is split in the same proportion. With the mean decoder-layer
cost and those fixed costs, `layout.balanced_split` finds the split with the smallest slowest stage.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from core import schedules
from core.layout import ParallelLayout, balanced_split
from training.metrics import visualdl_layout
from training.metrics.stage_timing import STAGE_DIR, read


def stage_summary(records: list[dict]) -> list[dict]:
    """One entry per stage (the mean over its tensor/data-parallel replicas)."""
    stages: dict[int, list[dict]] = {}
    for r in records:
        stages.setdefault(r["stage"], []).append(r)
    out = []
    for stage, rs in sorted(stages.items()):
        mean = {k: sum(r[k] for r in rs) / len(rs) for k in ("forward_ms", "backward_ms", "decoder_forward_share",
                                                              "pipeline_ms_per_step", "busy_ms_per_step")}
        mean["idle_fraction"] = 1 - mean["busy_ms_per_step"] / max(mean["pipeline_ms_per_step"], 1e-9)
        out.append({"stage": stage, "decoder_layers": rs[0]["decoder_layers"], "paddle_order": rs[0]["paddle_order"],
                    "steps": rs[0]["steps"], **mean})
    return out


def advice(summary: list[dict], layout: ParallelLayout) -> tuple[int, tuple, str]:
    """(bottleneck stage, suggested decoder layers per stage, message)."""
    total = [s["forward_ms"] + s["backward_ms"] for s in summary]
    slowest = max(range(len(total)), key=total.__getitem__)
    mean = sum(total) / len(total)
    layers = sum(s["decoder_layers"] for s in summary)  # every decoder layer lives on exactly one stage
    decoder = [t * s["decoder_forward_share"] for t, s in zip(total, summary)]
    per_layer = sum(decoder) / max(layers, 1)
    fixed = [t - d for t, d in zip(total, decoder)]
    lines = [f"pipeline stages ({layout.schedule}, {layout.accumulation_steps} micro-batches per step; ms per "
             "micro-batch):"]
    for s, t in zip(summary, total):
        lines.append(f"  stage {s['stage']}: {s['decoder_layers']} decoder layers, "
                     f"forward {s['forward_ms']:.2f} + backward {s['backward_ms']:.2f} = {t:.2f} ms, idle "
                     f"{s['idle_fraction']:.0%} of the step")
    if layout.virtual_stages > 1:
        suggestion = tuple(layout.stage_split)
        lines.append(f"bottleneck: stage {slowest} ({total[slowest] / mean - 1:+.0%} over the mean); interleaved "
                     "schedules need an even split, so no other split is suggested")
        return slowest, suggestion, "\n".join(lines)
    first, last = fixed[0], fixed[-1]  # embedding; norm + LM head + loss (middle stages: p2p only, left out)
    suggestion = balanced_split([per_layer] * layers, len(summary), first=first, last=last)
    predicted = _stage_costs(suggestion, per_layer, first, last)
    if suggestion == tuple(layout.stage_split) or max(predicted) >= total[slowest] * 0.97:
        lines.append(f"bottleneck: stage {slowest} ({total[slowest] / mean - 1:+.0%} over the mean); the split "
                     f"{list(layout.stage_split)} is already the most even one for these times")
        suggestion = tuple(layout.stage_split)
    else:
        lines.append(f"bottleneck: stage {slowest} ({total[slowest] / mean - 1:+.0%} over the mean); "
                     f"parallel.stage_layers={list(suggestion)} would even them out (slowest stage "
                     f"{total[slowest]:.2f} -> ~{max(predicted):.2f} ms per micro-batch)")
    return slowest, suggestion, "\n".join(lines)


def _stage_costs(split: tuple, per_layer: float, first: float, last: float) -> list[float]:
    costs = [n * per_layer for n in split]
    costs[0] += first
    costs[-1] += last
    return costs


def stage_imbalance(summary: list[dict]) -> float:
    """The slowest stage's compute (forward + backward per step) over the stages' mean: 1.0 is even. The numbers the
    advice uses."""
    return _slowest_over_mean([s["busy_ms_per_step"] for s in summary])


def _slowest_over_mean(busy: list[float]) -> float:
    return max(busy) / max(sum(busy) / len(busy), 1e-12)


def imbalance_by_step(run_dir: Path) -> dict[int, float]:
    """Each step's stage imbalance from the stages' VisualDL logs (visualdl/stage-<k>/: the same timer's per-step
    forward + backward), for the steps every stage logged; the steps not yet in visualdl/pipeline_parallel/ are written there
    (a resumed run's report adds its own steps, never one again). {step: imbalance} of the steps written now."""
    logs = Path(run_dir) / visualdl_layout.LOGDIR
    stages = sorted(logs.glob("stage-*"), key=lambda d: int(d.name.split("-")[1]))
    if len(stages) < 2:
        return {}
    per_stage = []
    for directory in stages:
        scalars = visualdl_layout.read_scalars(directory)
        forward, backward = scalars.get("stage/forward_ms", {}), scalars.get("stage/backward_ms", {})
        per_stage.append({step: forward[step] + backward.get(step, 0.0) for step in forward})
    done = set(visualdl_layout.read_scalars(logs / STAGE_DIR).get(visualdl_layout.IMBALANCE_TAG, {})) \
        if (logs / STAGE_DIR).is_dir() else set()
    steps = sorted(set.intersection(*(set(s) for s in per_stage)) - done)
    found = {step: _slowest_over_mean([s[step] for s in per_stage]) for step in steps}
    if found:
        from visualdl import LogWriter

        with LogWriter(logdir=str(logs / STAGE_DIR), file_name=visualdl_layout.new_file_name()) as writer:
            for step, value in found.items():
                writer.add_scalar(visualdl_layout.IMBALANCE_TAG, value, step)
    return found


def report(mlflow_client, run_id: str | None, run_dir: Path, layout: ParallelLayout) -> str | None:
    records = read(run_dir)
    if layout.pp < 2 or len({r["stage"] for r in records}) < layout.pp:
        return None
    summary = stage_summary(records)
    if any(s["steps"] < 1 for s in summary):
        return None
    v = layout.virtual_stages
    orders = []
    for s in summary:
        paddle = schedules.parse_paddle_order(s["paddle_order"]) if s["paddle_order"] else []
        orders.append(paddle or schedules.stage_order(layout.pipeline_schedule, layout.pp,
                                                      layout.accumulation_steps, v, s["stage"]))
    ours = [schedules.stage_order(layout.pipeline_schedule, layout.pp, layout.accumulation_steps, v, s)
            for s in range(layout.pp)]
    events = schedules.simulate(orders, v, [s["forward_ms"] for s in summary], [s["backward_ms"] for s in summary])
    slowest, suggestion, message = advice(summary, layout)
    measured = max(s["idle_fraction"] for s in summary)
    message += (f"\nidle fraction: measured {measured:.2f} (slowest-waiting stage), timeline of the measured times "
                f"{schedules.idle_fraction(events):.2f}, analytic bubble {layout.bubble_fraction:.2f}")
    out = run_dir / STAGE_DIR
    png = out / "timeline.png"
    schedules.render_png(events, png, f"{layout.name}: {layout.schedule}, {layout.accumulation_steps} micro-batches "
                         f"(measured stage times, ms)")
    stages = {"schedule": layout.schedule, "virtual_stages": v, "stages": summary,
              "order_matches_paddle": orders == ours, "bottleneck_stage": slowest,
              "suggested_stage_layers": list(suggestion), "timeline_idle_fraction": schedules.idle_fraction(events),
              "analytic_bubble": layout.bubble_fraction}
    imbalance = stage_imbalance(summary)
    stages["stage_imbalance"] = imbalance
    message += f"\nstage imbalance (slowest stage's compute / the mean): {imbalance:.2f}"
    (out / "stages.json").write_text(json.dumps(stages, indent=1))
    by_step = imbalance_by_step(run_dir)
    if mlflow_client and run_id:
        metrics = {"pipeline_measured_idle_fraction": measured, "stage_imbalance": imbalance}
        from mlflow.entities import Metric

        now, history = int(time.time() * 1000), list(by_step.items())  # (the same numbers as the VisualDL chart)
        for i in range(0, len(history), 500):
            mlflow_client.log_batch(run_id, metrics=[Metric("stage_imbalance_by_step", value, now, step)
                                                     for step, value in history[i:i + 500]])
        for s in summary:
            for key in ("forward_ms", "backward_ms", "idle_fraction"):
                metrics[f"stage{s['stage']}_{key}"] = s[key]
        for key, value in metrics.items():
            mlflow_client.log_metric(run_id, key, value)
        mlflow_client.set_tag(run_id, "pipeline.bottleneck_stage", str(slowest))
        mlflow_client.set_tag(run_id, "pipeline.suggested_stage_layers", ",".join(map(str, suggestion)))
        mlflow_client.log_artifact(run_id, str(png), STAGE_DIR)
        mlflow_client.log_artifact(run_id, str(out / "stages.json"), STAGE_DIR)
    return message
