"""One training-speed trial of `make bench`, in its own process (the CPU runtime settings must be in place before
paddle loads, so each setting needs a fresh process).

    python -m bench.training_speed --run-dir <a prepared run> --setting <name> --steps N

Measures, under one setting, on the run's model and data (the batch of its config):
- matmul peak: best fp32 matmul rate at a few sizes (the ceiling for MFU);
- the project's step: PaddleNLP Trainer as the worker builds it (training_arguments, make_trainer), eval and
  checkpoints off, median time between step ends;
- a bare Paddle loop: the same model, batches and AdamW, forward + backward + step, nothing else.
Prints one JSON line `TRIAL {...}`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
import shutil
import subprocess
import numpy as np
from core import REPO_ROOT, arithmetic
from core.config import DEFAULT_CONFIG, load_config
from core.tokenizer import load_tokenizer, model_vocab_size
from training.data import for_run
from training.data.read import train_dataset
from training.rank import make_trainer, prepare_model, training_arguments

# setting -> (environment before paddle loads, config overrides)
SPIN = {"PIPELINE_OMP_PASSIVE": "off"}  # OpenMP's default: threads spin 200 ms after each op (core/workarounds/cpu_runtime.py, fact 3)
NO_OPS = {"PIPELINE_CPU_LLAMA_OPS": "off"}  # PaddleNLP's own RMSNorm / rotary / loss code (model/llama.py)
SETTINGS = {
    # the baseline: one math thread, MKL's own CPU detection, eager forward, PaddleNLP's ops, spinning OpenMP threads
    "before": ({"PIPELINE_MKL_AMD_FIX": "off", **SPIN, **NO_OPS}, ["parallel.cpu_threads=1", "training.compile=false"]),
    "threads": ({"PIPELINE_MKL_AMD_FIX": "off", **SPIN, **NO_OPS}, ["parallel.cpu_threads=0", "training.compile=false"]),
    "threads+mkl": ({**SPIN, **NO_OPS}, ["parallel.cpu_threads=0", "training.compile=false"]),
    "threads+mkl+compile": ({**SPIN, **NO_OPS}, ["parallel.cpu_threads=0", "training.compile=true"]),
    # + KMP_BLOCKTIME=0
    "threads+mkl+compile+passive": (NO_OPS, ["parallel.cpu_threads=0", "training.compile=true"]),
    # + the CPU replacements of PaddleNLP's slow Llama ops: the project's default now
    "threads+mkl+compile+passive+ops": ({}, ["parallel.cpu_threads=0", "training.compile=true"]),
}


def prepared_run(out: Path, overrides: list[str], name: str = "runtime-run"):
    """(config, run directory `out/name`) of the default config with `overrides`, its data prepared, for trials to
    read."""
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    config = load_config(DEFAULT_CONFIG, overrides)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
    for_run(config, run_dir, log=lambda line: None)
    return config, run_dir


def trial(run_dir: Path, setting: str, steps: int, scratch: Path) -> dict:
    """One trial of `setting` in a fresh process (its environment set before paddle loads)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_DEBUG_CPU_TYPE", "PIPELINE_MKL_VERSION",
                                                            "KMP_BLOCKTIME")}
    env.update(SETTINGS[setting][0], PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-m", "bench.training_speed", "--run-dir", str(run_dir), "--setting",
                           setting, "--steps", str(steps), "--scratch", str(scratch)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("TRIAL ")), None)
    if line is None:
        raise RuntimeError(f"bench trial {setting} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[6:])


def matmul_peak(sizes=(512, 1024, 2048), repeats: int = 5) -> float:
    """Best fp32 matmul FLOP/s over a few square sizes (the machine is shared: the best run is the ceiling)."""
    import paddle

    best = 0.0
    for size in sizes:
        a, b = paddle.randn([size, size]), paddle.randn([size, size])
        paddle.matmul(a, b).numpy()
        for _ in range(repeats):
            t0 = time.perf_counter()
            paddle.matmul(a, b).numpy()
            best = max(best, 2 * size**3 / (time.perf_counter() - t0))
    return best


def project_step_times(config, run_dir: Path, steps: int, scratch: Path) -> list[float]:
    import paddle
    from paddlenlp.data import default_data_collator
    from paddlenlp.trainer import TrainerCallback

    from model.llama import build_model

    layout = config.layout()
    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    args = training_arguments(config, layout, scratch)
    args.do_eval, args.evaluation_strategy, args.save_strategy = False, "no", "no"
    paddle.seed(config.training.seed)
    model = prepare_model(config, build_model(config, load_tokenizer(run_dir / "tokenizer"), 1, 0, pipeline=False))
    trainer = make_trainer(model=model, args=args, train_dataset=train_dataset(run_dir / "data", quiet=True),
                           data_collator=default_data_collator, callbacks=[StepClock()])
    trainer.train()
    return [b - a for a, b in zip(ends, ends[1:])][1:]  # the first steps include warm-up


def bare_step_times(config, run_dir: Path, steps: int) -> list[float]:
    """The same model (compiled or not, as the setting says), batches and AdamW: forward + backward + step only."""
    import paddle

    from model.llama import build_model

    paddle.seed(config.training.seed)
    model = prepare_model(config, build_model(config, load_tokenizer(run_dir / "tokenizer"), 1, 0, pipeline=False))
    t = config.training
    optimizer = paddle.optimizer.AdamW(t.learning_rate, parameters=model.parameters(), weight_decay=t.weight_decay)

    batch = config.parallel.micro_batch_size
    samples = train_dataset(run_dir / "data", quiet=True).samples
    blocks = np.stack([samples[i]["text"] for i in range(min(len(samples), 64 * batch))])
    times = []
    for step in range(steps):
        block = paddle.to_tensor(blocks[(step * batch) % (len(blocks) - batch):][:batch].astype("int64"))
        t0 = time.perf_counter()
        loss = model(input_ids=block[:, :-1], labels=block[:, 1:], return_dict=False)[0]
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        float(loss)
        times.append(time.perf_counter() - t0)
    return times[2:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--setting", required=True, choices=sorted(SETTINGS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--scratch", required=True)
    args = parser.parse_args(argv)
    from core.workarounds import cpu_runtime

    run_dir = Path(args.run_dir)
    micro = load_config(run_dir / "config.yaml").parallel.micro_batch_size
    single = ["parallel.data=1", "parallel.tensor=1", "parallel.pipeline=1", "parallel.sharding_stage=0",
              "parallel.sharding_degree=1", "parallel.accumulation_steps=1", f"training.global_batch_size={micro}"]
    config = load_config(run_dir / "config.yaml", [*SETTINGS[args.setting][1], f"training.max_steps={args.steps}",
                                                   "training.warmup_steps=1",
                                                   *single])
    import paddle

    paddle.set_device("cpu")
    threads = config.layout().threads_per_rank()
    cpu_runtime.apply_threads(threads)
    peak = matmul_peak()
    ours = project_step_times(config, run_dir, args.steps, Path(args.scratch))
    bare = bare_step_times(config, run_dir, max(6, args.steps // 2))

    fpt = arithmetic.flops_per_token(config, model_vocab_size(load_tokenizer(run_dir / "tokenizer")))
    tokens = config.parallel.micro_batch_size * config.training.seq_length

    ours_s, bare_s = float(np.median(ours)), float(np.median(bare))
    print("TRIAL " + json.dumps({
        "setting": args.setting, "runtime": cpu_runtime.describe(threads), "matmul_peak_gflops": peak / 1e9,
        "tokens_per_s": tokens / ours_s, "step_s": ours_s, "bare_step_s": bare_s, "bare_tokens_per_s": tokens / bare_s,
        "flops_per_token": fpt, "mfu": tokens / ours_s * fpt / peak}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
