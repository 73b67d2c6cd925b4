"""Serving figures of `make bench`, both generation paths side by side (kv_cache vs full), one export:

- decode time per generated token after a short and a long prompt, in process (the cost of one more token);
- served generated tokens/s at 1, 2, 4, 8 concurrent HTTP clients, and errors;
- HTTP and gRPC overhead per request: p50 latency over HTTP / gRPC minus p50 in process, same request.
Trials are repeated and interleaved (path and prompt length alternate within each round); medians and ranges.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from core import exportdir
from core.config import DEFAULT_CONFIG, load_config

SHORT, LONG = 8, 120  # prompt tokens
CLIENTS = (1, 2, 4, 8)


def run(export_dir: Path, out: Path, quick: bool) -> dict:
    from serving.model import ExportedModel

    model = ExportedModel(export_dir)
    result = {"decode_ms_per_token": decode_per_token(model, rounds=2 if quick else 7)}
    for generation in ("kv_cache", "full"):
        result[generation] = served(export_dir, out, generation, model, quick)
    return result


def decode_per_token(model, rounds: int) -> dict:
    """Median time of one more token after a SHORT / LONG prompt, in process: one decode step (kv_cache) or one
    full-sequence forward of prompt + 1 tokens (full)."""
    cached_prefill, cached_decode = model.cached_session()
    full = exportdir.create_predictor(model.dir)
    rng = np.random.RandomState(0)
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for length in (SHORT, LONG):
            ids = rng.randint(5, len(model.tokenizer), size=(1, length)).astype("int64")
            positions, mask = np.arange(length, dtype="int64")[None], np.ones((1, length), "float32")
            _, keys, values = cached_prefill(ids, positions, mask)
            step = (ids[:, -1:], np.array([[length]], "int64"), np.ones((1, length + 1), "float32"), keys, values)
            longer = np.concatenate([ids, ids[:, -1:]], axis=1)
            for name, call in (("kv_cache", lambda: cached_decode(*step)),
                               ("full", lambda: exportdir.predict(full, longer))):
                call()
                samples.setdefault((name, length), []).extend(_timed(call, 5))
    table = {f"{name}_{length}": float(np.median(v) * 1000) for (name, length), v in samples.items()}
    for name in ("kv_cache", "full"):
        table[f"{name}_long_vs_short"] = table[f"{name}_{LONG}"] / table[f"{name}_{SHORT}"]
    return table


def served(export_dir: Path, out: Path, generation: str, model, quick: bool) -> dict:
    from core.processes import free_port
    from serving import server
    from serving.client import GenerationClient
    from serving.generation import GenerationSettings

    config = load_config(DEFAULT_CONFIG, [f"serving.http_port={free_port()}", f"serving.rpc_port={free_port()}",
                                          f"serving.generation={generation}"])
    prompt, new_tokens, count = "这本书", 8, (6 if quick else 40)
    settings = GenerationSettings(max_new_tokens=new_tokens)
    ids = model.encode(prompt)
    if generation == "kv_cache":
        session = model.cached_session()
        in_process = lambda: model.generate_batch(session, [ids], [settings])  # noqa: E731
    else:
        predictor = exportdir.create_predictor(model.dir)
        in_process = lambda: model.generate(lambda x: exportdir.predict(predictor, x), ids, settings)  # noqa: E731
    state_dir = out / f"serving-{generation}"
    local = _timed(in_process, count // 2)  # half before, half after the server: the same machine conditions
    state = server.start(config, export_dir, state_dir)
    try:
        client = GenerationClient(state["http_url"], state["rpc_address"], timeout=60)
        http = _timed(lambda: client.generate(prompt, max_new_tokens=new_tokens), count)
        grpc = _timed(lambda: client.generate_grpc(prompt, max_new_tokens=new_tokens), count)
        load = [load_test(lambda: len(GenerationClient(state["http_url"], timeout=60).generate(
            prompt, max_new_tokens=16).token_ids), n, 1.0 if quick else 8) for n in CLIENTS]
    finally:
        server.stop(state_dir)
    local += _timed(in_process, count - count // 2)
    p50 = lambda values: float(np.median(values) * 1000)  # noqa: E731
    base = load[0]["tokens_per_s"]
    return {"op_processes": state.get("op_processes"), "in_process_p50_ms": p50(local),
            "http_p50_ms": p50(http), "grpc_p50_ms": p50(grpc),
            "http_overhead_p50_ms": p50(http) - p50(local), "grpc_overhead_p50_ms": p50(grpc) - p50(local),
            "concurrency": [{**c, "vs_1_client": c["tokens_per_s"] / base if base else 0.0} for c in load]}


def load_test(call, clients: int, duration_s: float) -> dict:
    """`clients` threads calling `call()` (it returns the generated token count) for `duration_s`."""
    tokens, done, errors, lock, first_error = [0], [0], [0], threading.Lock(), []
    stop_at = time.perf_counter() + duration_s

    def worker():
        while time.perf_counter() < stop_at:
            try:
                n = call()
                with lock:
                    done[0] += 1
                    tokens[0] += n
            except Exception as exc:  # noqa: BLE001  (counted, not raised: this is a load test)
                with lock:
                    errors[0] += 1
                    first_error[:] = first_error or [f"{exc.__class__.__name__}: {str(exc)[:200]}"]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    return {"clients": clients, "requests": done[0], "errors": errors[0], "tokens_per_s": tokens[0] / elapsed,
            "req_per_s": done[0] / elapsed, "first_error": first_error[0] if first_error else ""}


def _timed(call, count: int) -> list[float]:
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def markdown(sv: dict) -> list[str]:
    d = sv["decode_ms_per_token"]
    lines = ["", "Serving (same export; kv_cache = prefill + decode programs with batching, full = the full-sequence "
             "graph re-run for every token):", "",
             "| figure | kv_cache | full |", "|---|---|---|",
             f"| ms per generated token after {SHORT} / {LONG} prompt tokens (in process) | "
             f"{d[f'kv_cache_{SHORT}']:.2f} / {d[f'kv_cache_{LONG}']:.2f} ({d['kv_cache_long_vs_short']:.2f}x) | "
             f"{d[f'full_{SHORT}']:.2f} / {d[f'full_{LONG}']:.2f} ({d['full_long_vs_short']:.2f}x) |"]
    k, f = sv["kv_cache"], sv["full"]
    for key, label in (("in_process_p50_ms", "8 new tokens p50, in process (ms)"),
                       ("http_overhead_p50_ms", "HTTP overhead over in process, p50 (ms)"),
                       ("grpc_overhead_p50_ms", "gRPC overhead over in process, p50 (ms)")):
        lines.append(f"| {label} | {k[key]:.1f} | {f[key]:.1f} |")
    for ck, cf in zip(k["concurrency"], f["concurrency"]):
        lines.append(f"| {ck['clients']} HTTP clients: generated tokens/s (vs 1 client), errors | "
                     f"{ck['tokens_per_s']:.0f} ({ck['vs_1_client']:.2f}x), {ck['errors']} | "
                     f"{cf['tokens_per_s']:.0f} ({cf['vs_1_client']:.2f}x), {cf['errors']} |")
    return lines
