"""What VisualDL's writers cost a training step (training/metrics/visualdl_writers.py): the same pp2 run with `visualdl.enabled` on and
off, alternating, `rounds` times each, each a fresh `pipeline train` (bench/suite.py train_run); the step time is
MLflow's `step_time_s` median over the run without its first logging interval. Paired rounds on a 2-core machine
drift by more than the writers cost, so the writers also time themselves in the loop (training/metrics/visualdl_writers.py
writer_cost.json): the busiest process's writer time a step over the step time. And the stage balance: a pp2 and a pp4
run with deliberately unequal stages, their stage imbalance (the stage report's), then the split the report suggests,
applied, and its imbalance.

    python -m bench.monitor_cost [--rounds 3] [--out reports/bench/monitor]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench import between_trials, spread
from bench.suite import train_run
from core import REPO_ROOT
from training.metrics.visualdl_writers import COST_FILE

PP2 = ["parallel.pipeline=2", "parallel.micro_batch_size=4", "parallel.accumulation_steps=2",
       "training.max_steps=60", "training.logging_interval=4", "training.eval_interval=1000",
       "training.save_interval=1000"]


def cost(out: Path, uri: str, rounds: int) -> dict:
    steps: dict[str, list[float]] = {"on": [], "off": []}
    inside: list[float] = []  # the busiest process's writer time a step / the step time
    for r in range(rounds):
        for setting in (("on", "off") if r % 2 == 0 else ("off", "on")):
            between_trials()
            run = train_run(f"vdl-{setting}-{r}-{int(time.time())}", [*PP2, f"visualdl.enabled={setting == 'on'}"],
                            out, uri)
            steps[setting].append(run["step_time_s"])
            if setting == "on":  # (the writers' own time in the loop, per process: rank 0 holds train/ and stage-0/)
                costs = {d.name: json.loads((d / COST_FILE).read_text())
                         for d in (Path(run["run_dir"]) / "visualdl").iterdir() if (d / COST_FILE).is_file()}
                per_step = {name: c["seconds"] / c["steps"] for name, c in costs.items()}
                rank0 = per_step.get("train", 0.0) + per_step.get("stage-0", 0.0)
                inside.append(max(rank0, per_step.get("stage-1", 0.0)) / run["step_time_s"])
            print(f"[bench] round {r + 1} visualdl {setting}: step {run['step_time_s'] * 1000:.1f} ms", flush=True)
    ratios = [a / b for a, b in zip(steps["on"], steps["off"])]
    return {"step_time_s": {k: spread(v) for k, v in steps.items()}, "on_over_off_by_round": ratios,
            "cost_fraction_paired": statistics.median(ratios) - 1,
            "cost_fraction_in_the_writers": spread(inside)}


def balance(out: Path, uri: str, name: str, overrides: list[str]) -> dict:
    """The unequal split's imbalance, the report's suggestion applied, its imbalance."""
    first = train_run(f"{name}-unequal-{int(time.time())}", overrides, out, uri)
    stages = json.loads((Path(first["run_dir"]) / "pipeline_parallel" / "stages.json").read_text())
    suggested = stages["suggested_stage_layers"]
    applied = [o for o in overrides if not o.startswith("parallel.stage_layers=")]
    second = train_run(f"{name}-suggested-{int(time.time())}", [*applied, f"parallel.stage_layers={suggested}"],
                       out, uri)
    after = json.loads((Path(second["run_dir"]) / "pipeline_parallel" / "stages.json").read_text())
    result = {"unequal": [s["decoder_layers"] for s in stages["stages"]], "imbalance": stages["stage_imbalance"],
              "suggested": suggested, "imbalance_after": after["stage_imbalance"],
              "step_time_s": [first["step_time_s"], second["step_time_s"]]}
    print(f"[bench] {name}: {result}", flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.monitor_cost")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(REPO_ROOT / "reports" / "bench" / "monitor"))
    p.add_argument("--skip-balance", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    result = {"cost": cost(out, uri, args.rounds)}
    if not args.skip_balance:
        layers = ["model.num_layers=8", "training.max_steps=40"]
        result["pp2"] = balance(out, uri, "pp2", [*PP2, *layers, "parallel.stage_layers=[6,2]"])
        result["pp4"] = balance(out, uri, "pp4", ["parallel.pipeline=4", "parallel.micro_batch_size=2",
                                                  "parallel.accumulation_steps=4", *PP2[3:], *layers,
                                                  "parallel.stage_layers=[5,1,1,1]"])
    (out / "monitor.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
