"""`make bench`: the benchmark suite. Every figure is measured in this run and every ratio uses this run's numbers.

1. CPU runtime (bench/training_speed.py): the default config's training tokens/s, MFU against the matmul peak
   measured in the same process, and the project's step against a bare Paddle loop, for each runtime setting (the
   baseline, + threads, + MKL's AMD switch, + compiled forward, ...), fresh processes, interleaved rounds;
2. parallel scaling: tokens/s of every CPU layout (dp2, tp2, pp2, pp2 interleaved, sharding1x2, tp2pp2, dp2tp2,
   and dp2/tp2/dp2tp2 in semi-automatic mode) against single on the same global batch; per pipeline schedule the
   measured idle fraction against its analytic bubble; semi-auto against manual (tokens/s, peak memory); `make
   plan`'s step-time estimate of each manual layout against its measured step (the ranking, reported);
3. pipeline overhead: our training step (tracking, checkpoints, eval) against a bare PaddleNLP Trainer; the
   training loop's pause per checkpoint with asynchronous and synchronous writes (interleaved runs);
4. export: wall time of its stages; the decode program's ops and step (bench/decode_step.py) and where a decode
   step's time goes at batch 1, 64 and 256 (bench/step_parts.py), before/after switched in the same run;
5. serving (bench/serving_load.py): tokens/s, time to first token and per token at 1-32 concurrent HTTP clients,
   continuous against static batching in alternating rounds; HTTP / gRPC overhead over in process;
6. data (bench/data_prep.py): `make data` at 1 and 2 workers against the previous in-process path on a 1x and an 8x
   corpus (MB/s, peak RSS), and a training rank's peak RSS on each.
Writes reports/bench/bench.json and bench.md (or --out) and logs them as a run of the MLflow experiment `bench`.
"""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
import dataclasses

import numpy as np
from scipy.stats import spearmanr

from bench import between_trials, spread
from core import REPO_ROOT, exportdir, tracking
from core.config import DEFAULT_CONFIG
from bench import data_prep, decode_step, peer_vllm, size_sweep, step_parts
from bench.peer_vllm import ensure_env
from bench.training_speed import SETTINGS, prepared_run, trial
from core import registry
from core.config import load_config
from core.errors import ConfigError
from core.layout import ParallelLayout
from core.processes import free_port
from pipeline import plan
from pipeline.runner import seaweedfs
from training.checkpoint.upload import UPLOADED

# Model FLOPs per trained token: 6 N (forward + backward of every weight) + 12 L h s (attention scores and values,
# forward + backward; L layers, h hidden size, s sequence length) -- the PaLM-appendix estimate.
FLOPS_NOTE = "6N + 12Lhs per token, N = weights without the embedding table"
# The layouts are compared on the base of the layout configs (global batch 8), whatever the default config says.
SMALL_CONFIG = REPO_ROOT / "configs" / "tiny-small.yaml"
BASE = ["data.max_documents=3000", "tokenizer.min_frequency=1", "training.eval_interval=1000",
        "training.save_interval=1000", "training.logging_interval=2", "training.warmup_steps=1"]


def train_run(name: str, overrides: list[str], out: Path, uri: str) -> dict:
    """A real `pipeline train` in a subprocess; returns its MLflow metrics (tokens/s without the first interval)."""
    cmd = [sys.executable, "-m", "pipeline", "train", "--config", str(SMALL_CONFIG),
           f"training.runs_dir={out / 'runs'}", f"training.run_name={name}", "tracking.experiment=bench-train",
           f"export.exports_dir={out / 'exports'}", "export.registered_model_name=bench-model", *BASE, *overrides]
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, PYTHONPATH=str(REPO_ROOT))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"bench training {name} failed:\n{proc.stderr[-3000:]}")
    client = tracking.client(uri)
    run_id = json.loads((out / "runs" / name / "mlflow_run.json").read_text())["run_id"]
    history = lambda key: list(tracking.metric_history(client, run_id, key).values())  # noqa: E731
    speeds, steps = history("tokens_per_second")[1:], history("step_time_s")[1:]
    return {"run_id": run_id, "tokens_per_s": float(np.median(speeds)), "step_time_s": float(np.median(steps)),
            "train_runtime_s": history("train_runtime")[-1], "wall_s": wall, "run_dir": str(out / "runs" / name)}


# --quick checks the harness, not the machine: shorter sequences, and a slice of the corpus to prepare (~1 s, not ~10)
QUICK = ["training.seq_length=32", "data.max_documents=2000"]


def runtime_trials(out: Path, repeats: int, steps: int, quick: bool) -> dict:
    """CPU runtime settings on the default config: each setting of bench/training_speed.py SETTINGS in a fresh process,
    the settings interleaved (rotated each round) `repeats` times; median and min-max of every figure."""
    config, run_dir = prepared_run(out, QUICK if quick else [])
    # (quick: the two ends only -- the harness check, not the measurement)
    names = [list(SETTINGS)[0], list(SETTINGS)[-1]] if quick else list(SETTINGS)
    trials: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(repeats):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            between_trials()
            trials[name].append(trial(run_dir, name, steps, out / "scratch"))
            print(f"[bench] round {round_ + 1} {name}: {trials[name][-1]['tokens_per_s']:.0f} tok/s", flush=True)
    figures = ("tokens_per_s", "bare_tokens_per_s", "matmul_peak_gflops", "mfu", "step_s", "bare_step_s")
    summary = {name: {"runtime": t[-1]["runtime"], **{f: spread([x[f] for x in t]) for f in figures},
                      "ours_vs_bare": spread([x["step_s"] / x["bare_step_s"] for x in t])}
               for name, t in trials.items()}
    base = summary["before"]["tokens_per_s"]["median"]
    for name in names:
        summary[name]["speedup_vs_before"] = summary[name]["tokens_per_s"]["median"] / base
    return {"config": "configs/tiny.yaml", "batch_tokens": config.parallel.micro_batch_size * config.training.seq_length,
            "repeats": repeats, "steps": steps, "settings": summary}


def bare_trainer_step_time(run_dir: Path, steps: int) -> float:
    """The same model, data and batch with a plain PaddleNLP Trainer: no eval, no checkpoints, no tracking."""
    code = f"""
import core, json, sys
from pathlib import Path
import paddle
from core.config import load_config
from core.layout import ParallelLayout
from paddlenlp.data import default_data_collator
from paddlenlp.trainer import Trainer, TrainingArguments
from core.tokenizer import load_tokenizer
from training.data.read import train_dataset
from model.llama import build_model
run_dir = Path({str(run_dir)!r})
config = load_config(run_dir / "config.yaml")
paddle.set_device("cpu")
paddle.seed(config.training.seed)
model = build_model(config, load_tokenizer(run_dir / "tokenizer"), 1, 0, pipeline=False)
args = TrainingArguments(output_dir=str(run_dir / "bare"), max_steps={steps},
    per_device_train_batch_size=config.parallel.micro_batch_size, learning_rate=config.training.learning_rate,
    logging_steps=1000, save_strategy="no", evaluation_strategy="no", report_to=["none"], disable_tqdm=True,
    device="cpu", no_cuda=True, skip_memory_metrics=True, seed=config.training.seed)
trainer = Trainer(model=model, args=args, train_dataset=train_dataset(run_dir / "data", quiet=True),
                  data_collator=default_data_collator)
out = trainer.train()
print("BARE", json.dumps(out.metrics))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    line = next((l for l in proc.stdout.splitlines() if l.startswith("BARE ")), None)
    if line is None:
        raise RuntimeError(f"bare Trainer run failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[5:])["train_runtime"] / steps


SECTIONS = ("runtime", "scaling", "decode", "steps", "sizes", "serving", "prefix", "generate", "data", "gateway")
# `make bench` without FULL=1: the figures a person asks of this machine, in 15 minutes or less; serving and generate
# serve the default model's latest registered version, or a single run trained and exported for them
DEFAULT_SECTIONS = ("decode", "steps", "sizes", "serving", "generate")
# Minutes a section takes on 2 cores, announced before it starts when this output directory has no earlier full-size
# run (else that run's own times, bench.json section_s). "training + export": the single run serving and generate
# need when no model is registered. Measured 2026-12-06: decode, sizes, serving, generate (`make bench`: 10 min 32 s
# in all) and the vLLM peer; the other sections are shares of the last full run's 38 minutes.
MINUTES = {"runtime": 9, "scaling": 12, "training + export": 1.5, "decode": 1, "steps": 1.2, "sizes": 4.5,
           "serving": 3.5, "generate": 1.5, "data": 3, "gateway": 3, "vllm peer": 15, "prefix": 5}
_clock: dict = {"last": {}, "took": {}, "open": None}


def announce(section: str, quick: bool) -> None:
    """One line before a section starts, saying how long it takes (quick: the harness check, under a minute); the
    section before it is timed to here (bench.json section_s)."""
    _close_section()
    last = _clock["last"].get(section)
    took = ("under a minute (--quick)" if quick else f"about {last / 60:.1f} min (its last run here)" if last
            else f"about {MINUTES[section]:g} min (2 cores)")
    print(f"[bench] {section}: {took}", flush=True)
    _clock["open"] = (section, time.perf_counter())


def _close_section() -> None:
    if _clock["open"]:
        name, t0 = _clock["open"]
        _clock["took"][name] = time.perf_counter() - t0
        _clock["open"] = None


def _start_clock(out: Path) -> None:
    try:
        previous = json.loads((out / "bench.json").read_text())
    except (OSError, ValueError):
        previous = {}
    _clock.update(last={} if previous.get("quick", True) else previous.get("section_s", {}), took={}, open=None)


def out_dir(out: str | Path | None) -> Path:
    """Where the bench writes (default reports/bench), created; absolute (the servers it starts run elsewhere: a
    relative --out named a service config they could not find)."""
    path = Path(out).resolve() if out else REPO_ROOT / "reports" / "bench"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run(quick: bool = False, out: Path | None = None, sections: tuple[str, ...] = SECTIONS, export: str = "",
        peers: tuple[str, ...] = ()) -> dict:
    out = out_dir(out)
    uri = f"sqlite:///{out / 'bench-mlflow.db'}"
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "quick": quick,
                     "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"}
    _start_clock(out)
    if "runtime" in sections:
        announce("runtime", quick)
        results["runtime"] = runtime_trials(out, repeats=1 if quick else 3, steps=6 if quick else 16, quick=quick)
        for name, v in results["runtime"]["settings"].items():
            print(f"[bench] {name}: {v['tokens_per_s']['median']:.0f} tok/s ({v['speedup_vs_before']:.2f}x before), "
                  f"MFU {v['mfu']['median']:.1%}, peak {v['matmul_peak_gflops']['median']:.0f} GFLOP/s", flush=True)
    if "decode" in sections:
        announce("decode", quick)
        results["decode"] = decode_step.run(quick)
    if "steps" in sections:
        announce("steps", quick)
        results["steps"] = step_parts.run(quick)
    if "sizes" in sections:
        announce("sizes", quick)
        results["sizes"] = size_sweep.run(out, quick, _peer_python(peers))
    if not export and "scaling" not in sections:
        export = _registered_default()
    if export or (peers and not {"scaling", "serving", "prefix", "generate", "gateway"} & set(sections)):
        # (an export given -- a directory or models:/..., as make serve takes -- or only the peers, against the
        # default model's latest registered version: serve and generate with it, nothing trained)
        from core import registry

        export = str(registry.resolve(load_config(DEFAULT_CONFIG), export))
        _serve_and_generate(results, Path(export), out, quick, sections, peers)
    elif {"scaling", "serving", "prefix", "generate", "gateway"} & set(sections) or peers:
        _scaling_and_export(results, out, uri, quick, sections, peers)
    if "data" in sections:
        announce("data", quick)
        results["data"] = data_prep.run(out, uri, quick)
    results.pop("runs", None)
    _close_section()
    results["section_s"] = dict(_clock["took"])
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    (out / "bench.md").write_text(markdown(results))
    _log_to_mlflow(results, out)
    print(markdown(results))
    return results


def _peer_python(peers: tuple[str, ...]) -> Path | None:
    if "vllm" not in peers:
        return None

    return ensure_env()


def _registered_default() -> str:
    """The default model's latest registered version (what `make serve` serves), or "" when there is none."""
    try:
        return str(registry.resolve(load_config(DEFAULT_CONFIG), ""))
    except ConfigError:
        return ""


def _scaling_and_export(results: dict, out: Path, uri: str, quick: bool, sections: tuple[str, ...],
                        peers: tuple[str, ...] = ()) -> None:
    """The layouts' runs (only the single one when `scaling` is not asked for), the plan against them, the step
    against a bare Trainer, checkpoint stalls; then the single run's export, served (serving) and generated over a
    table (generate)."""
    steps = 6 if quick else 40
    stamp = time.strftime("%H%M%S")
    announce("scaling" if "scaling" in sections else "training + export", quick)
    scaling = _scaling(out, uri, steps, stamp, quick, only_single="scaling" not in sections)
    results.update(scaling)
    if "runtime" in results:
        peak = list(results["runtime"]["settings"].values())[-1]["matmul_peak_gflops"]["median"]
        results["plan_vs_measured"] = plan_vs_measured(scaling["runs"], peak)
    single = scaling["runs"]["single"]
    if "scaling" not in sections:
        results.pop("scaling")
    if not quick and "scaling" in sections:  # (the runtime trials already compare the project's step with a bare loop)
        bare = bare_trainer_step_time(Path(single["run_dir"]), steps)
        ours = single["train_runtime_s"] / steps
        results["pipeline_overhead"] = {"ours_step_s": ours, "bare_trainer_step_s": bare, "ratio": ours / bare,
                                        "ours_includes": "eval + checkpoint at the last step, MLflow logging"}
        print(f"[bench] step: ours {ours * 1000:.1f} ms vs bare Trainer {bare * 1000:.1f} ms", flush=True)
    if not quick and "scaling" in sections:  # (tests/integration/test_resume.py asserts the async pause; this measures it against sync)
        results["checkpoints"] = checkpoint_stall(out, uri, stamp)
    t0 = time.perf_counter()
    meta = _export(single["run_id"], uri)
    results["export"] = {"wall_s": time.perf_counter() - t0, **meta["timings_s"],
                         "parity_max_abs_error": meta["parity_max_abs_error"]}
    _serve_and_generate(results, Path(meta["export_dir"]), out, quick, sections, peers)


def _serve_and_generate(results: dict, export_dir: Path, out: Path, quick: bool, sections: tuple[str, ...],
                        peers: tuple[str, ...] = ()) -> None:
    from bench import batch_generate, serving_load

    if "serving" in sections:
        announce("serving", quick)
        results["serving"] = serving_load.run(export_dir, out, quick)
    if "prefix" in sections:
        from bench import prefix_load

        announce("prefix", quick)
        results["prefix"] = prefix_load.run(export_dir, out, quick)
    if "generate" in sections:
        announce("generate", quick)
        results["generate"] = batch_generate.run(export_dir, out, quick)
    if "gateway" in sections:
        from bench import gateway_load

        announce("gateway", quick)
        results["gateway"] = gateway_load.run(export_dir, out, quick)
    if "vllm" in peers:  # (opt-in: its own environment, bench/peer_vllm.py)
        announce("vllm peer", quick)
        results["peer_vllm"] = peer_vllm.run(export_dir, out, quick)


def _scaling(out: Path, uri: str, steps: int, stamp: str, quick: bool, only_single: bool = False) -> dict:
    """Tokens/s of every CPU layout against single on the same global batch (8); per pipeline schedule the measured
    idle fraction next to the analytic bubble; semi-automatic next to manual parallel (tokens/s, peak memory)."""
    layouts = {k: LAYOUTS[k] for k in (("single",) if only_single else ("single", "dp2") if quick else LAYOUTS)}
    runs = {}
    for name, overrides in layouts.items():
        runs[name] = train_run(f"{name}-{stamp}", [*overrides, f"training.max_steps={steps}",
                                                   *(QUICK if quick else [])], out, uri)
        print(f"[bench] {name}: {runs[name]['tokens_per_s']:.0f} tok/s", flush=True)
    single = runs["single"]
    result = {"runs": runs, "scaling": {
        name: {"tokens_per_s": r["tokens_per_s"], "step_time_s": r["step_time_s"],
               "speedup_vs_single": r["tokens_per_s"] / single["tokens_per_s"]} for name, r in runs.items()}}
    if "pp2" in runs:
        result["pipeline_schedules"] = pipeline_schedules({k: runs[k] for k in ("pp2", "pp2v2", "tp2pp2")})
        result["semi_auto"] = semi_auto_vs_manual(runs)
    return result


# A model whose checkpoint takes a measurable time to write (~8.6M parameters: ~100 MB with the AdamW moments).
CHECKPOINT_MODEL = ["model.hidden_size=256", "model.intermediate_size=688", "model.num_layers=8",
                    "model.num_attention_heads=8", "model.num_key_value_heads=8"]


def checkpoint_stall(out: Path, uri: str, stamp: str, rounds: int = 3, steps: int = 12) -> dict:
    """How long the training loop pauses per checkpoint (`checkpoint_stall_s`: from the start of the save to the
    end of the save callbacks on rank 0), with training.async_checkpoint off, on, and on with every checkpoint
    uploaded to a local S3 store (SeaweedFS, storage.uri), in interleaved runs; and the upload's MB/s."""
    store = seaweedfs.start(out / "object-store", free_port())
    os.environ.update(seaweedfs.environment(store))  # (the training subprocesses read the store's environment)
    settings = {"sync": ["training.async_checkpoint=false"], "async": ["training.async_checkpoint=true"],
                "async+store": ["training.async_checkpoint=true", "storage.upload_wait_s=600"],
                # (the same with one file at a time: what storage.transfer_threads' parallel uploads gain)
                "async+store-serial": ["training.async_checkpoint=true", "storage.upload_wait_s=600",
                                       "storage.transfer_threads=1"]}
    uploads_by: dict[str, list[float]] = {name: [] for name in settings}
    stalls: dict[str, list[float]] = {name: [] for name in settings}
    runtimes: dict[str, list[float]] = {name: [] for name in settings}
    sizes = []
    try:
        for i in range(rounds):
            for name, extra in settings.items():
                between_trials()
                store_uri = [f"storage.uri=s3://bench/ckpt-{stamp}-{i}-{name.split('+')[-1]}"] if "store" in name else []
                r = train_run(f"ckpt-{name}-{i}-{stamp}", [*CHECKPOINT_MODEL, *extra, *store_uri,
                                                            f"training.max_steps={steps}", "training.eval_interval=2",
                                                            "training.save_interval=2", "training.keep_checkpoints=0"],
                              out, uri)
                stalls[name] += list(tracking.metric_history(tracking.client(uri), r["run_id"],
                                                             "checkpoint_stall_s").values())
                runtimes[name].append(r["train_runtime_s"])  # (the whole loop: do background writes slow the steps?)
                latest = Path(r["run_dir"]) / "checkpoints" / f"checkpoint-{steps}"
                sizes.append(sum(f.stat().st_size for f in latest.rglob("*") if f.is_file()))
                uploads_by[name] += _upload_rates(Path(r["run_dir"]))
    finally:
        seaweedfs.stop(out / "object-store")
    result = {name: spread(v) for name, v in stalls.items()}
    result.update(saves_per_setting=len(stalls["sync"]), checkpoint_mb=float(np.median(sizes)) / 2**20,
                  train_runtime_s={name: spread(v) for name, v in runtimes.items()},
                  async_vs_sync=result["async"]["median"] / result["sync"]["median"],
                  store_vs_async=result["async+store"]["median"] / result["async"]["median"],
                  upload_mb_per_s=spread(uploads_by["async+store"]),
                  upload_mb_per_s_one_file_at_a_time=spread(uploads_by["async+store-serial"]))
    print(f"[bench] checkpoint stall: sync {result['sync']['median'] * 1000:.0f} ms, async "
          f"{result['async']['median'] * 1000:.0f} ms, async + store {result['async+store']['median'] * 1000:.0f} ms "
          f"per save ({result['checkpoint_mb']:.0f} MB; uploads {result['upload_mb_per_s']['median']:.0f} MB/s, one "
          f"file at a time {result['upload_mb_per_s_one_file_at_a_time']['median']:.0f} MB/s)",
          flush=True)
    return result


def _upload_rates(run_dir: Path) -> list[float]:
    """MB/s of each checkpoint upload, from rank 0's log (training/checkpoint/upload.py UPLOADED lines)."""
    found = re.findall(rf"^{re.escape(UPLOADED)} checkpoint-\d+: ([\d.]+) MB in ([\d.]+)s$",
                       (run_dir / "logs" / "workerlog.0").read_text(errors="replace"), re.M)
    return [float(mb) / max(float(seconds), 1e-9) for mb, seconds in found]


# pp2 with 4 micro-batches of 2: 1F1B and interleaved (which needs m >= 2p) see the same batches
PP2 = ["parallel.pipeline=2", "parallel.micro_batch_size=2", "parallel.accumulation_steps=4"]
SEMI_AUTO_PAIRS = ("dp2", "tp2", "dp2tp2")
LAYOUTS = {"single": [], "dp2": ["parallel.data=2", "parallel.micro_batch_size=4"],
           "tp2": ["parallel.tensor=2"],
           "pp2": PP2,
           "pp2v2": [*PP2, "parallel.schedule=interleaved-1F1B", "parallel.virtual_stages=2"],
           "sharding1x2": ["parallel.sharding_stage=1", "parallel.sharding_degree=2", "parallel.micro_batch_size=4"],
           "tp2pp2": ["parallel.tensor=2", *PP2],
           "dp2tp2": ["parallel.data=2", "parallel.tensor=2", "parallel.micro_batch_size=4"]}
LAYOUTS |= {f"{name}-semi": ["parallel.mode=semi_auto", *LAYOUTS[name]] for name in SEMI_AUTO_PAIRS}
# `make plan`'s bandwidths for gloo over TCP loopback on one machine: an assumption (order of magnitude), stated in
# the report; the tiny model's messages are small enough that the ranking hardly depends on it.
LOOPBACK_GBPS = 1.0


def plan_vs_measured(runs: dict, peak_gflops: float) -> dict:
    """`make plan`'s step-time model against the measured step times of the manual layouts (reported, not asserted):
    this machine as a cluster of `world size` devices, each with its share of the measured fp32 matmul peak, the
    utilisation calibrated so that the single-process estimate equals its measured step; then the estimate of every
    other layout, and the rank correlation of estimated vs measured step time."""
    names = [n for n in runs if not n.endswith("-semi") and n != "pp2v2"]  # the plan models manual 1F1B layouts

    def estimate(name: str, utilisation: float) -> float:
        config = load_config(SMALL_CONFIG, [*BASE, *LAYOUTS[name]])
        c = config.layout()
        world = c.world_size
        cluster = dataclasses.replace(config.cluster, gpus=world, gpus_per_node=world, utilisation=utilisation,
                                      peak_tflops=peak_gflops / 1000 / world, intra_node_gbps=LOOPBACK_GBPS,
                                      inter_node_gbps=LOOPBACK_GBPS)
        return plan.step_time(dataclasses.replace(config, cluster=cluster), c)["total_s"]

    utilisation = estimate("single", 1.0) / runs["single"]["step_time_s"]
    rows = {n: {"estimated_step_s": estimate(n, utilisation), "measured_step_s": runs[n]["step_time_s"]}
            for n in names}
    order = lambda key: sorted(names, key=lambda n: rows[n][key])  # noqa: E731
    rho = float(spearmanr([rows[n]["estimated_step_s"] for n in names],
                          [rows[n]["measured_step_s"] for n in names]).statistic) if len(names) > 2 else None
    return {"calibrated_utilisation": utilisation, "loopback_gbps_assumed": LOOPBACK_GBPS, "layouts": rows,
            "estimated_order": order("estimated_step_s"), "measured_order": order("measured_step_s"),
            "spearman": rho}


def pipeline_schedules(runs: dict) -> dict:
    """Per pipeline run: its schedule's analytic bubble, the idle fraction its ranks measured (pipeline step time
    minus their own forward/backward time; the stage that waits most), and the idle fraction of the timeline laid
    out from the measured stage times (training/metrics/stage_report.py)."""
    out = {}
    for name, r in runs.items():
        stages = json.loads((Path(r["run_dir"]) / "pipeline_parallel" / "stages.json").read_text())
        out[name] = {"schedule": stages["schedule"], "virtual_stages": stages["virtual_stages"],
                     "analytic_bubble": stages["analytic_bubble"],
                     "measured_idle_fraction": max(s["idle_fraction"] for s in stages["stages"]),
                     "timeline_idle_fraction": stages["timeline_idle_fraction"], "tokens_per_s": r["tokens_per_s"]}
    return out


def peak_memory_mib(run_dir: str) -> float:
    """The largest per-rank peak of tensor memory (training/metrics/mlflow_logger.py PeakMemory)."""
    files = (Path(run_dir) / "memory").glob("rank*.json")
    return max(json.loads(f.read_text())["peak_allocated_bytes"] for f in files) / 2**20


def semi_auto_vs_manual(runs: dict) -> dict:
    return {name: {"manual_tokens_per_s": runs[name]["tokens_per_s"],
                   "semi_auto_tokens_per_s": runs[f"{name}-semi"]["tokens_per_s"],
                   "semi_vs_manual": runs[f"{name}-semi"]["tokens_per_s"] / runs[name]["tokens_per_s"],
                   "manual_peak_mib": peak_memory_mib(runs[name]["run_dir"]),
                   "semi_auto_peak_mib": peak_memory_mib(runs[f"{name}-semi"]["run_dir"])}
            for name in SEMI_AUTO_PAIRS}


def _export(run_id: str, uri: str) -> dict:
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-m", "pipeline", "export", "--run-id", run_id, "export.hf=true"],
                          cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench export failed:\n{proc.stderr[-3000:]}")
    registered = next(line for line in proc.stdout.splitlines() if line.startswith("registered model "))
    export_dir = registered.split(": ", 1)[1]  # "registered model 'name' version N: <export dir>"
    meta = exportdir.read_meta(Path(export_dir))
    return {**meta, "export_dir": export_dir}


def markdown(r: dict) -> str:
    lines = [f"Bench {r['date']} on {r['machine']}{' (quick)' if r['quick'] else ''}", ""]
    if "runtime" in r:
        lines += _runtime_lines(r["runtime"])
    if "scaling" in r:
        lines += _training_lines(r)
    return "\n".join(lines + _stage_sections(r)) + "\n"


def _runtime_lines(rt: dict) -> list[str]:
    lines = [f"Training speed of {rt['config']} ({rt['batch_tokens']} tokens a step), each setting in a fresh "
             f"process, {rt['repeats']} interleaved rounds: median [min-max]. MFU: {FLOPS_NOTE}, against the fp32 "
             "matmul peak measured in the same process.", "",
             "| setting | threads | MKL_DEBUG_CPU_TYPE | KMP_BLOCKTIME | matmul peak GFLOP/s | tokens/s | vs before "
             "| MFU | bare-loop tokens/s | ours / bare step |", "|---|---|---|---|---|---|---|---|---|---|"]
    mm = lambda v, f="{:.0f}": f"{f.format(v['median'])} [{f.format(v['min'])}-{f.format(v['max'])}]"  # noqa: E731
    for name, v in rt["settings"].items():
        lines.append(f"| {name} | {v['runtime']['threads']} | {v['runtime']['mkl_debug_cpu_type']} | "
                     f"{v['runtime'].get('kmp_blocktime', 'unset')} | "
                     f"{mm(v['matmul_peak_gflops'])} | {mm(v['tokens_per_s'])} | {v['speedup_vs_before']:.2f}x | "
                     f"{mm({k: x * 100 for k, x in v['mfu'].items()}, '{:.1f}')}% | {mm(v['bare_tokens_per_s'])} | "
                     f"{mm(v['ours_vs_bare'], '{:.2f}')} |")
    return lines


def _training_lines(r: dict) -> list[str]:
    s = r["scaling"]
    lines = ["", "| figure | value |", "|---|---|"]
    lines += [f"| {name} tokens/s (vs single) | {v['tokens_per_s']:.0f} ({v['speedup_vs_single']:.2f}x) |"
              for name, v in s.items()]
    if "pipeline_schedules" in r:
        lines += ["", "| pipeline run | schedule | analytic bubble | measured idle | idle of the measured timeline "
                  "| tokens/s |", "|---|---|---|---|---|---|"]
        for name, p in r["pipeline_schedules"].items():
            lines.append(f"| {name} | {p['schedule']}{' v' + str(p['virtual_stages']) if p['virtual_stages'] > 1 else ''}"
                         f" | {p['analytic_bubble']:.2f} | {p['measured_idle_fraction']:.2f} | "
                         f"{p['timeline_idle_fraction']:.2f} | {p['tokens_per_s']:.0f} |")
        lines += ["", "| layout | manual tokens/s | semi-auto tokens/s | semi / manual | manual peak MiB/rank "
                  "| semi-auto peak MiB/rank |", "|---|---|---|---|---|---|"]
        for name, v in r["semi_auto"].items():
            lines.append(f"| {name} | {v['manual_tokens_per_s']:.0f} | {v['semi_auto_tokens_per_s']:.0f} | "
                         f"{v['semi_vs_manual']:.2f}x | {v['manual_peak_mib']:.1f} | {v['semi_auto_peak_mib']:.1f} |")
    if "plan_vs_measured" in r:
        pv = r["plan_vs_measured"]
        rho = "" if pv["spearman"] is None else f"; Spearman {pv['spearman']:.2f}"
        lines += ["", f"`make plan`'s step-time model on this machine (utilisation calibrated on single: "
                  f"{pv['calibrated_utilisation']:.1%}; gloo loopback assumed {pv['loopback_gbps_assumed']:g} GB/s):"
                  f" estimated order {' < '.join(pv['estimated_order'])}; measured order "
                  f"{' < '.join(pv['measured_order'])}{rho}", "",
                  "| layout | estimated step ms | measured step ms |", "|---|---|---|"]
        lines += [f"| {n} | {v['estimated_step_s'] * 1000:.1f} | {v['measured_step_s'] * 1000:.1f} |"
                  for n, v in pv["layouts"].items()]
    lines += ["", "| figure | value |", "|---|---|"]
    if "pipeline_overhead" in r:
        o = r["pipeline_overhead"]
        lines.append(f"| step time ours / bare PaddleNLP Trainer | {o['ours_step_s'] * 1000:.1f} ms / "
                     f"{o['bare_trainer_step_s'] * 1000:.1f} ms = {o['ratio']:.2f}x |")
    if "checkpoints" in r:
        c, ms = r["checkpoints"], lambda v: f"{v['median'] * 1000:.0f} [{v['min'] * 1000:.0f}-{v['max'] * 1000:.0f}]"
        lines.append(f"| training paused per checkpoint ({c['checkpoint_mb']:.0f} MB, {c['saves_per_setting']} saves "
                     f"each), ms: synchronous / asynchronous | {ms(c['sync'])} / {ms(c['async'])} = "
                     f"{c['async_vs_sync']:.2f}x |")
        lines.append(f"| paused per checkpoint, asynchronous + uploads to the object store / asynchronous alone | "
                     f"{ms(c['async+store'])} / {ms(c['async'])} = {c['store_vs_async']:.2f}x; uploads "
                     f"{c['upload_mb_per_s']['median']:.0f} [{c['upload_mb_per_s']['min']:.0f}-"
                     f"{c['upload_mb_per_s']['max']:.0f}] MB/s (one file at a time: "
                     f"{c['upload_mb_per_s_one_file_at_a_time']['median']:.0f} MB/s) |")
        rt = c["train_runtime_s"]
        lines.append(f"| training loop of those runs (s): synchronous / asynchronous / + store | "
                     f"{rt['sync']['median']:.1f} / {rt['async']['median']:.1f} / {rt['async+store']['median']:.1f} |")
    e = r["export"]
    lines.append(f"| export wall (load / convert / parity / MLflow model) | {e['wall_s']:.1f} s "
                 f"({e['load_s']:.1f} / {e['convert_s']:.1f} / {e['parity_s']:.1f} / {e.get('mlflow_model_s', 0):.1f} s), parity "
                 f"{e['parity_max_abs_error']:.1e} |")
    return lines


def _stage_sections(r: dict) -> list[str]:
    """The serving and data sections, as their own modules write them."""
    from bench import batch_generate, data_prep, serving_load


    lines = decode_step.markdown(r.get("decode")) + step_parts.markdown(r.get("steps"))
    lines += size_sweep.markdown(r.get("sizes"))
    lines += serving_load.markdown(r["serving"]) if "serving" in r else []
    if "generate" in r:
        lines += [""] + batch_generate.markdown(r["generate"])
    if "data" in r:
        lines += [""] + data_prep.markdown(r["data"])
    if "gateway" in r:
        from bench import gateway_load

        lines += [""] + gateway_load.markdown(r["gateway"])
    if "peer_vllm" in r:
        lines += [""] + peer_vllm.markdown(r["peer_vllm"])
    return lines


def _log_to_mlflow(results: dict, out: Path) -> None:
    uri = tracking.tracking_uri()
    client = tracking.client(uri)
    experiment = tracking.experiment_id(client, "bench", uri)
    run = client.create_run(experiment, run_name=f"bench-{results['date']}", tags={"pipeline.stage": "bench",
                                                                                   "machine": results["machine"]})

    def flat(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                yield from flat(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, dict) and "clients" in item:
                    yield from flat(f"{prefix}.c{item['clients']}", {k: v for k, v in item.items() if k != "clients"})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield prefix, float(value)

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    # MLflow metric names: alphanumerics and _ - . / : and space ("threads+mkl" -> "threads_mkl")
    metrics = [Metric(re.sub(r"[^\w\-./:]", "_", key), value, now, 0) for key, value in flat("", results)]
    for i in range(0, len(metrics), 500):
        client.log_batch(run.info.run_id, metrics=metrics[i:i + 500])
    client.log_artifact(run.info.run_id, str(out / "bench.json"))
    client.log_artifact(run.info.run_id, str(out / "bench.md"))
    client.set_terminated(run.info.run_id, "FINISHED")
    print(f"[bench] logged to MLflow experiment 'bench', run {run.info.run_id}", flush=True)
