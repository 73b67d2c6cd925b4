"""`make bench` section `steps`: where a decode step's time goes, at batch 1, 64 and 256 (the default model's shape,
random weights, one math thread: a serving worker's), greedy, sampled (temperature 0.8) and top-k (40, make
generate's bench table's sampled rows): feeding the program,
the program itself, fetching its outputs, appending the new keys and values to the cache, choosing the tokens
(sampling) and the rest of the scheduler's step. `after` is this checkout; `before` switches off, in the same run,
reading the cache in place (runtime.cache_session zero_copy: the whole cache copied into the predictor each step),
the decode program's argmax (export format 3's program: the logits fetched every step) and drawing sampled rows
together (generation.SAMPLE_TOGETHER: one row at a time in float64). Rounds
alternate the two; every figure is the median [min-max] over rounds of the mean per step."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import between_trials, spread
from bench.decode_step import DEFAULT_VOCAB, default_model
from core.exportdir import DECODE_PREFIX, PREFILL_PREFIX
from serving.engine import generation, runtime
from serving.engine.scheduler import Job, Scheduler
from serving.protocol import GenerationSettings

BATCHES = (1, 64, 256)
PROMPT, NEW = 16, 64  # tokens a prompt, tokens generated (no end token: every row runs NEW steps)
MODES = {"greedy": {}, "sampled": {"temperature": 0.8}, "top-k 40": {"temperature": 0.9, "top_k": 40}}
PARTS = (*runtime.STEP_PARTS, "sampling", "scheduler")


class _TimedScheduler(Scheduler):
    """The scheduler, its token choice timed (`choosing`, seconds; a format 4 step's logits, fetched there when a
    row needs them, count as the session's fetch, not here)."""

    def __init__(self, timings: dict, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.timings, self.choosing = timings, 0.0

    def _choose(self, jobs, logits) -> None:
        t0, fetched = time.perf_counter(), self.timings.get("fetch", 0.0)
        super()._choose(jobs, logits)
        self.choosing += time.perf_counter() - t0 - (self.timings.get("fetch", 0.0) - fetched)


def _steps(session, timings: dict, batch: int, sampling: dict, seed: int) -> dict:
    """Mean ms a decode step of one batch spends in each part, and the step's whole time."""
    prefill, decode = session
    scheduler = _TimedScheduler(timings, prefill, decode, eos_id=-1, banned_ids=[0], usable_vocab=DEFAULT_VOCAB,
                                max_length=PROMPT + NEW + 1, max_batch_size=batch)
    rng = np.random.default_rng(seed)
    for i in range(batch):
        scheduler.add(Job(i, rng.integers(5, DEFAULT_VOCAB, PROMPT).tolist(),
                          GenerationSettings(max_new_tokens=NEW, seed=seed + i, **sampling)))
    scheduler.step()  # (the prefill and the first decode step: not counted)
    timings.clear()
    scheduler.choosing, steps, t0 = 0.0, 0, time.perf_counter()
    while scheduler.running:
        scheduler.step()
        steps += 1
    whole = time.perf_counter() - t0
    parts = {part: timings.get(part, 0.0) for part in runtime.STEP_PARTS}
    parts["sampling"] = scheduler.choosing
    parts["scheduler"] = whole - sum(parts.values())
    return {**{part: seconds / steps * 1000 for part, seconds in parts.items()}, "step": whole / steps * 1000}


def program_dirs() -> dict[str, Path]:
    """{"before": format 3's programs, "after": this checkout's (format 4)} of one random default-shape model."""
    from export import programs

    model, workdir = default_model(DEFAULT_VOCAB), Path(tempfile.mkdtemp(prefix="bench-steps-"))
    dirs = {variant: workdir / variant for variant in ("before", "after")}
    programs.save_programs(model, dirs["after"])
    dirs["before"].mkdir()  # (the same prefill; only the decode program differs, so only it is converted again)
    for ext in ("pdmodel", "pdiparams"):
        shutil.copyfile(dirs["after"] / f"{PREFILL_PREFIX}.{ext}", dirs["before"] / f"{PREFILL_PREFIX}.{ext}")
    programs.save_decode(model, dirs["before"] / DECODE_PREFIX, greedy=False)
    return dirs


def run(quick: bool) -> dict:
    dirs = program_dirs()
    timings = {"before": {}, "after": {}}
    sessions = {"before": runtime.cache_session(dirs["before"], zero_copy=False, timings=timings["before"]),
                "after": runtime.cache_session(dirs["after"], timings=timings["after"])}
    batches, rounds = ((1, 64) if quick else BATCHES), (1 if quick else 3)
    samples: dict = {}
    for round_ in range(rounds):
        for batch in batches:
            for mode, sampling in MODES.items():
                for variant in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
                    between_trials()
                    generation.SAMPLE_TOGETHER = variant == "after"
                    try:
                        got = _steps(sessions[variant], timings[variant], batch, sampling, round_)
                    finally:
                        generation.SAMPLE_TOGETHER = True
                    samples.setdefault((variant, mode, batch), []).append(got)
    result = {variant: {mode: {str(batch): {key: spread([s[key] for s in samples[(variant, mode, batch)]])
                                            for key in (*PARTS, "step")}
                               for batch in batches} for mode in MODES} for variant in ("before", "after")}
    for mode in MODES:
        for batch in map(str, batches):
            before, after = (result[v][mode][batch]["step"]["median"] for v in ("before", "after"))
            result["after"][mode][batch]["speedup"] = before / after
            print(f"[bench] steps: {mode} batch {batch}: {before:.2f} -> {after:.2f} ms a step "
                  f"({before / after:.2f}x)", flush=True)
    return result


def markdown(r: dict | None) -> list[str]:
    if not r:
        return []
    lines = ["", "### Where a decode step's time goes (the default model's shape, one math thread, ms a step)", "",
             "`before`: the cache copied into the predictor each step, the logits fetched every step (export "
             "format 3's decode program) and sampled rows one at a time (switched off in the same run); rounds "
             "alternate.", "",
             "| mode | batch | version | " + " | ".join(PARTS) + " | step | speed-up |",
             "|---|---|---|" + "---|" * (len(PARTS) + 2)]
    for mode in MODES:
        for batch in r["after"][mode]:
            for variant in ("before", "after"):
                row = r[variant][mode][batch]
                cells = " | ".join(f"{row[p]['median']:.2f}" for p in PARTS)
                step, speedup = row["step"], f"{row['speedup']:.2f}x" if "speedup" in row else ""
                lines.append(f"| {mode} | {batch} | {variant} | {cells} | {step['median']:.2f} "
                             f"[{step['min']:.2f}-{step['max']:.2f}] | {speedup} |")
    return lines


def _trial(program_dir: str, variant: str, batch: int, start_at: float, seconds: float) -> dict:
    """One process's share of a workers trial (`python -m bench.step_parts trial ...`): from `start_at` (the other
    processes' start too), greedy batches decoded for `seconds`; then the fp32 matmul rate of this process alone
    for the same time (the compute the core gives while the others do the same)."""
    session = runtime.cache_session(Path(program_dir) / variant, zero_copy=variant == "after")  # (untimed parts)
    _steps(session, {}, batch, {}, 0)  # (warm: the first run at each shape allocates)
    time.sleep(max(0.0, start_at - time.time()))
    tokens, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        _steps(session, {}, batch, {}, tokens)
        tokens += batch * NEW
    decode_rate = tokens / (time.perf_counter() - t0)
    a = np.random.default_rng(0).standard_normal((512, 512)).astype("float32")
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds / 2:
        a @ a
        count += 1
    return {"tokens_per_s": decode_rate, "matmul_gflops": count * 2 * 512 ** 3 / (time.perf_counter() - t0) / 1e9}


def workers(program_dir: Path, rounds: int, seconds: float, batch: int = 256) -> dict:  # (program_dirs' parent)
    """Greedy decode tokens/s of 1 and 2 processes at once (one math thread each, as serving's workers), before and
    after, rounds alternating: does a second worker add its share?"""
    samples: dict = {}
    for round_ in range(rounds):
        for variant in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
            for processes in (1, 2):
                between_trials()
                start_at = time.time() + 15.0  # (each process loads its predictors and warms up first)
                procs = [subprocess.Popen([sys.executable, "-m", "bench.step_parts", "trial", str(program_dir),
                                           variant, str(batch), str(start_at), str(seconds)],
                                          stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
                         for _ in range(processes)]
                got = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
                key = (variant, processes)
                samples.setdefault(key, []).append({
                    "tokens_per_s": sum(g["tokens_per_s"] for g in got),
                    "matmul_gflops": sum(g["matmul_gflops"] for g in got)})
    return {f"{variant} x{processes}": {k: spread([s[k] for s in v]) for k in v[0]}
            for (variant, processes), v in samples.items()}


if __name__ == "__main__":
    if sys.argv[1] == "trial":
        print(json.dumps(_trial(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6]))))
    elif sys.argv[1] == "workers":  # python -m bench.step_parts workers [rounds] [seconds]
        print(json.dumps(workers(program_dirs()["after"].parent, int(sys.argv[2]) if len(sys.argv) > 2 else 2,
                                 float(sys.argv[3]) if len(sys.argv) > 3 else 8.0), indent=1))
