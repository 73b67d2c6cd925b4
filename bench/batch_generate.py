"""`make generate` against the in-process engine on the same prompts and batch size.

The ceiling: one process running the continuous-batching scheduler over every prompt at once
(serving/engine/worker.py generate_all) with one math thread (on this model, more threads are slower: a batch's
matmuls are too small to split). Against it: `make generate` with one worker (the same compute: its overhead) and
with one worker per core (what users get). Tokens/s after the model has loaded, in fresh processes, trials
interleaved over rounds. `python -m bench.batch_generate --trial ...` is one trial.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from core import REPO_ROOT
from bench import between_trials, spread
from core.config import DEFAULT_CONFIG, load_config
from serving.engine.exported import ExportedModel
from serving.engine.worker import build_scheduler, generate_all
from serving.offline.batch import read_table, request_of
from serving.protocol import Limits

VARIANTS = ("in_process", "make_generate_1_worker", "make_generate")
WORDS = ("人工智能", "这本书", "快递很快，", "今天天气", "我们的", "中国", "学习", "电影很好看", "服务员", "价格")


def prompts(path: Path, count: int, new_tokens: int, sampled: bool = True) -> Path:
    """`count` rows of WORDS; every other one sampled (seeded), or all greedy."""
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(count):
            row = {"id": i, "prompt": "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))),
                   "max_new_tokens": new_tokens}
            if not sampled:
                row.update(temperature=0)
            elif i % 2:
                row.update(temperature=0.9, top_k=40, seed=i)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def in_process_trial(export_dir: Path, table: Path, batch_size: int) -> dict:
    s = load_config(DEFAULT_CONFIG).serving
    limits = Limits(max_prompt_chars=1 << 24, max_new_tokens_limit=s.max_new_tokens_limit)
    model = ExportedModel(export_dir)
    scheduler = build_scheduler(model, 1, "kv_cache", max_batch_size=batch_size)
    requests = [(r.prompt, r.settings) for r in (request_of(row, limits) for row in read_table(table))]
    t0 = time.perf_counter()
    results = generate_all(model, scheduler, requests)
    seconds = time.perf_counter() - t0
    tokens = sum(len(r["token_ids"]) for r in results)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def make_generate_trial(export_dir: Path, table: Path, out: Path, batch_size: int, workers: int) -> dict:
    target = out / f"generated-{time.time_ns()}.jsonl"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "generate", "--model", str(export_dir), "--input",
                           str(table), "--output", str(target), "--workers", str(workers),
                           f"serving.generate_batch_size={batch_size}"],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    target.unlink()
    summary = json.loads(proc.stdout.strip().splitlines()[-1].split("generate: done ", 1)[1])
    return {"tokens": summary["tokens"], "seconds": summary["seconds"], "tokens_per_s": summary["tokens_per_s"]}


def run(export_dir: Path, out: Path, quick: bool) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    count, new_tokens, rounds = (100, 8, 1) if quick else (2000, 16, 3)
    batch_size = load_config(DEFAULT_CONFIG).serving.generate_batch_size
    table = prompts(out / "generate-prompts.jsonl", count, new_tokens)
    trials: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            between_trials()
            proc = subprocess.run([sys.executable, "-m", "bench.batch_generate", "--trial", variant, "--model",
                                   str(export_dir), "--table", str(table), "--out", str(out), "--batch-size",
                                   str(batch_size)], capture_output=True, text=True, cwd=REPO_ROOT)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-2000:])
            trials[variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"[bench] generate {variant}: {trials[variant][-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    result = {"prompts": count, "new_tokens": new_tokens, "batch_size": batch_size, "rounds": rounds,
              **{v: spread([t["tokens_per_s"] for t in trials[v]]) for v in VARIANTS}}
    result["ratio"] = result["make_generate"]["median"] / result["in_process"]["median"]
    result["ratio_1_worker"] = result["make_generate_1_worker"]["median"] / result["in_process"]["median"]
    return result


def markdown(r: dict) -> list[str]:
    return [f"### Batch generation ({r['prompts']:,} prompts x {r['new_tokens']} tokens, batch {r['batch_size']}, "
            f"{r['rounds']} interleaved rounds)", "",
            "| engine | tokens/s median | min | max |", "|---|---|---|---|",
            *(f"| {v} | {r[v]['median']:.0f} | {r[v]['min']:.0f} | {r[v]['max']:.0f} |" for v in VARIANTS), "",
            f"`make generate` / in-process: **{r['ratio']:.2f}x** (one worker per core), "
            f"**{r['ratio_1_worker']:.2f}x** (one worker: the same compute)"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trial", choices=VARIANTS, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--table", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    args = p.parse_args()
    if args.trial == "in_process":
        result = in_process_trial(Path(args.model), Path(args.table), args.batch_size)
    else:
        workers = 1 if args.trial == "make_generate_1_worker" else 0
        result = make_generate_trial(Path(args.model), Path(args.table), Path(args.out), args.batch_size, workers)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
