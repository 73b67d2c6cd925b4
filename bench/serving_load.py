"""Serving figures of `make bench`: the server under 1..32 concurrent HTTP clients, continuous batching against static
batching (`serving.scheduler`), both measured in the same run on the same export.

- in process: one request alone through the worker's scheduler (the reference for the overhead), and the scheduler's
  own ceiling with 8 sequences kept running (closed loop, no server);
- served, per scheduler: generated tokens/s at 1, 2, 4, 8, 16, 32 closed-loop clients (each sends its next request
  when the last is answered), time to first token and time per output token (server-side, from every answer) p50 /
  p99, request latency p50, errors; and the per-request overhead of Paddle Serving's HTTP and gRPC and of the
  OpenAI-compatible HTTP route: p50 latency of a 1-token request from one client minus p50 of the same request in
  process, the four timed in turn (interleaved, 100 times a round). One new token: the cost of a request's trip,
  without the decode steps, whose time drifts with the machine more than the trip costs.
The two schedulers run in alternating rounds (static, continuous, static, ...) with the server restarted for each,
so that drift of a noisy machine falls on both; figures are the median over rounds.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import requests

from bench import between_trials
from core import exportdir
from core.config import DEFAULT_CONFIG, load_config
from core.processes import free_ports
from serving import controller
from serving.client.client import GenerationClient, ServingError
from serving.engine.exported import ExportedModel
from serving.engine.scheduler import Job
from serving.engine.worker import build_scheduler
from serving.protocol import GenerationSettings
from serving.server.sizes import workers

CLIENTS = (1, 2, 4, 8, 16, 32)
STREAM_CLIENTS = (1, 8, 32)  # streaming time to first token on the OpenAI route
PROMPTS = ("人工智能", "这本书", "快递很快，", "我们今天去", "天气不错，适合")
NEW_TOKENS = 32
OVERHEAD_TOKENS = 1  # (the overhead trials: see the docstring)


def run(export_dir: Path, out: Path, quick: bool) -> dict:
    clients = (1, 4) if quick else CLIENTS
    rounds, duration = (1, 1.0) if quick else (2, 6.0)
    figures, alone = in_process(export_dir, quick)
    result = {"new_tokens": NEW_TOKENS, "clients": list(clients), "in_process": figures}
    samples: dict[str, list[dict]] = {"static": [], "continuous": []}
    for _ in range(rounds):
        for scheduler in ("static", "continuous"):
            between_trials()
            samples[scheduler].append(served(export_dir, out, scheduler, clients, duration, quick, alone))
    for scheduler, runs in samples.items():
        result[scheduler] = _median_of(runs)
    base = result["continuous"]["load"][0]["tokens_per_s"]
    for row in result["continuous"]["load"]:
        row["vs_1_client"] = row["tokens_per_s"] / base if base else 0.0
    return result


def in_process(export_dir: Path, quick: bool):
    """One request alone through the scheduler, as a worker runs it; and 8 sequences kept running (closed loop).
    Returns the figures and the alone request (served() times it again, interleaved with the served requests)."""
    config = load_config(DEFAULT_CONFIG)
    model = ExportedModel(export_dir)
    scheduler = build_scheduler(model, config.serving.predictor_threads or 1, "kv_cache")
    ids = [model.encode(p) for p in PROMPTS]

    def alone(new_tokens: int = NEW_TOKENS) -> None:
        job = Job(0, ids[0], GenerationSettings(max_new_tokens=new_tokens))
        scheduler.add(job)
        while not scheduler.idle:
            scheduler.step()
        model.decode(job.new)  # (as the worker does before answering)

    alone()
    times = _timed(alone, 5 if quick else 30)

    tokens, count, t0 = 0, 0, time.perf_counter()
    for count in range(8):
        scheduler.add(Job(count, ids[count % 5], GenerationSettings(NEW_TOKENS, 1.0, 0, count)))
    while time.perf_counter() - t0 < (1.0 if quick else 4.0):
        for outcome in scheduler.step():
            tokens += len(outcome.job.new)
            count += 1
            scheduler.add(Job(count, ids[count % 5], GenerationSettings(NEW_TOKENS, 1.0, 0, count)))
    ceiling = tokens / (time.perf_counter() - t0)
    return {"alone_p50_ms": float(np.median(times) * 1000), "alone_tokens_per_s": NEW_TOKENS / float(np.median(times)),
            "batch8_tokens_per_s": ceiling}, alone


def server_config(*overrides: str):
    """The default config with the server on four free ports (distinct: the OS may repeat one) and `overrides`."""
    ports = [f"serving.{key}={port}" for key, port in zip(("http_port", "rpc_port", "api_port", "metrics_port"),
                                                          free_ports(4))]
    return load_config(DEFAULT_CONFIG, [*ports, *overrides])


def served(export_dir: Path, out: Path, scheduler: str, clients: tuple, duration: float, quick: bool,
           alone) -> dict:
    config = server_config(f"serving.scheduler={scheduler}")
    state_dir = out / f"serving-{scheduler}"
    try:  # (the start too: a signal while it waits for readiness still stops the server)
        state = controller.start(config, export_dir, state_dir, owner="bench")
        client = GenerationClient(state["http_url"], state["rpc_address"], timeout=60)
        session, body = requests.Session(), {"model": exportdir.read_meta(export_dir)["registered_model_name"],
                                             "prompt": PROMPTS[0], "max_tokens": OVERHEAD_TOKENS, "temperature": 0}
        trials = {"in_process": lambda: alone(OVERHEAD_TOKENS),
                  "http": lambda: client.generate(PROMPTS[0], max_new_tokens=OVERHEAD_TOKENS),
                  "grpc": lambda: client.generate_grpc(PROMPTS[0], max_new_tokens=OVERHEAD_TOKENS),
                  "openai": lambda: session.post(f"{state['openai_base_url']}/completions", json=body,
                                                 timeout=60).raise_for_status()}
        times: dict[str, list[float]] = {name: [] for name in trials}
        for _ in range(10 if quick else 100):  # interleaved: the four see the same machine
            for name, call in trials.items():
                between_trials()
                times[name] += _timed(call, 1)
        load = [load_test(state["http_url"], n, duration) for n in clients]
        streaming = [stream_ttft(state, body["model"], n, duration) for n in ((1, 4) if quick else STREAM_CLIENTS)] \
            if scheduler == "continuous" else []
    finally:
        controller.stop(state_dir)

    return {"workers": workers(config.serving), "load": load, "streaming": streaming,
            **{f"{name}_p50_ms": float(np.median(values) * 1000) for name, values in times.items()}}


def closed_loop(clients: int, duration_s: float, setup, ask, failures) -> tuple[list, list[str], float]:
    """`clients` threads for `duration_s`, each sending its next request when the last is answered:
    `ask(setup(), index, k)` is a thread's k-th request (its result kept), an exception of `failures` an error. The
    one client harness of the serving sections: (results, errors as one line each, elapsed seconds)."""
    results, errors, lock = [], [], threading.Lock()
    stop_at = time.perf_counter() + duration_s

    def worker(index: int) -> None:
        own, k = setup(), 0
        while time.perf_counter() < stop_at:
            try:
                result = ask(own, index, k)
                with lock:
                    results.append(result)
            except failures as exc:
                with lock:
                    errors.append(f"{exc.__class__.__name__}: {str(exc)[:200]}")
            k += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors, time.perf_counter() - t0


def load_test(url: str, clients: int, duration_s: float) -> dict:
    """`clients` closed-loop clients of the Paddle Serving route (serving/client/client.py)."""
    def ask(client, index: int, k: int) -> tuple:
        t0 = time.perf_counter()
        g = client.generate(PROMPTS[(index + k) % 5], max_new_tokens=NEW_TOKENS, temperature=1.0, seed=index * 1000 + k)
        return len(g.token_ids), time.perf_counter() - t0, g.ttft_ms, g.tpot_ms

    answers, errors, elapsed = closed_loop(clients, duration_s, lambda: GenerationClient(url, timeout=60), ask,
                                           (ServingError, OSError))
    column = lambda i: np.array([a[i] for a in answers]) if answers else np.zeros(1)  # noqa: E731
    return {"clients": clients, "requests": len(answers), "errors": len(errors),
            "tokens_per_s": float(column(0).sum() / elapsed), "latency_p50_ms": float(np.median(column(1)) * 1000),
            "ttft_p50_ms": float(np.percentile(column(2), 50)), "ttft_p99_ms": float(np.percentile(column(2), 99)),
            "tpot_p50_ms": float(np.percentile(column(3), 50)), "tpot_p99_ms": float(np.percentile(column(3), 99)),
            "first_error": errors[0] if errors else ""}


def stream_ttft(state: dict, model: str, clients: int, duration_s: float, max_tokens: int = NEW_TOKENS,
                greedy: bool = False, headers: dict | None = None) -> dict:
    """`clients` closed-loop streaming clients on the OpenAI route (`/v1/completions`, any server that has it: this
    project's or a peer's): time from sending to the first chunk that carries text, as a client sees it (p50 / p99),
    and to the last; generated tokens/s from each answer's usage (`stream_options.include_usage`). Sampled with a seed
    per request, or greedy."""
    url = f"{state['openai_base_url']}/completions"

    def ask(session, index: int, k: int) -> tuple:
        body = {"model": model, "prompt": PROMPTS[(index + k) % 5], "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True},
                **({"temperature": 0} if greedy else {"temperature": 1.0, "seed": index * 1000 + k})}
        t0, seen, used = time.perf_counter(), None, 0
        with session.post(url, json=body, stream=True, timeout=60, headers=headers) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                if seen is None and b'"text": ""' not in line and b'"text":""' not in line and b'"text"' in line:
                    seen = time.perf_counter() - t0
                if b'"usage"' in line:
                    used = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens") or used
        return seen if seen is not None else time.perf_counter() - t0, time.perf_counter() - t0, used

    answers, errors, elapsed = closed_loop(clients, duration_s, requests.Session, ask, requests.RequestException)
    first, total = [a[0] for a in answers], [a[1] for a in answers]
    # inter-token latency as the client sees it: after the first token, the answer's time per further token
    itl = [(a[1] - a[0]) / (a[2] - 1) for a in answers if a[2] > 1]
    ms = lambda values, q: float(np.percentile(values, q) * 1000) if values else 0.0  # noqa: E731
    return {"clients": clients, "requests": len(first), "errors": len(errors), "ttft_p50_ms": ms(first, 50),
            "ttft_p99_ms": ms(first, 99), "latency_p50_ms": ms(total, 50), "itl_p50_ms": ms(itl, 50),
            "tokens_per_s": sum(a[2] for a in answers) / elapsed}


def _median_of(runs: list[dict]) -> dict:
    """The median over rounds of every figure, with the overhead of each route over the in-process request timed in
    the same rounds."""
    med = lambda values: float(np.median(values))  # noqa: E731
    load = []
    for i, row in enumerate(runs[0]["load"]):
        rows = [r["load"][i] for r in runs]
        load.append({"clients": row["clients"], "errors": sum(r["errors"] for r in rows),
                     "requests": sum(r["requests"] for r in rows), "first_error": rows[0]["first_error"],
                     **{k: med([r[k] for r in rows]) for k in row if k.endswith(("_s", "_ms"))},
                     "tokens_per_s_range": [min(r["tokens_per_s"] for r in rows),
                                            max(r["tokens_per_s"] for r in rows)]})
    p50 = {name: med([r[f"{name}_p50_ms"] for r in runs]) for name in ("in_process", "http", "grpc", "openai")}
    streaming = []
    for i, row in enumerate(runs[0].get("streaming", [])):
        rows = [r["streaming"][i] for r in runs]
        streaming.append({"clients": row["clients"], "errors": sum(r["errors"] for r in rows),
                          "requests": sum(r["requests"] for r in rows),
                          **{k: med([r[k] for r in rows]) for k in row if k.endswith("_ms")}})
    return {"workers": runs[0]["workers"], "streaming": streaming, **{f"{name}_p50_ms": v for name, v in p50.items()},
            **{f"{name}_overhead_p50_ms": p50[name] - p50["in_process"] for name in ("http", "grpc", "openai")},
            "load": load}


def _timed(call, count: int) -> list[float]:
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def markdown(sv: dict) -> list[str]:
    ip, c, s = sv["in_process"], sv["continuous"], sv["static"]
    lines = ["", f"Serving ({sv['new_tokens']} new tokens a request, sampled; closed-loop HTTP clients; static = a "
             "batch is formed only when nothing runs, continuous = requests join between decode steps):", "",
             f"In process: one request alone {ip['alone_p50_ms']:.1f} ms p50 ({ip['alone_tokens_per_s']:.0f} tokens/s); "
             f"8 sequences kept running: {ip['batch8_tokens_per_s']:.0f} tokens/s.", "",
             f"Overhead over in process (a 1-token request, p50 of 100 interleaved a round; in process "
             f"{c['in_process_p50_ms']:.1f} ms): Paddle Serving HTTP {c['http_overhead_p50_ms']:.1f} ms, its gRPC "
             f"{c['grpc_overhead_p50_ms']:.1f} ms, the OpenAI-compatible HTTP route {c['openai_overhead_p50_ms']:.1f} "
             f"ms (static: {s['http_overhead_p50_ms']:.1f} / {s['grpc_overhead_p50_ms']:.1f} / "
             f"{s['openai_overhead_p50_ms']:.1f})."]
    if c.get("streaming"):
        lines += ["", "Streaming on the OpenAI route (`stream: true`, closed-loop clients, time to the first chunk "
                      "with text as the client sees it; inter-token: the time per token after the first):", "",
                  "| clients | TTFT p50 / p99 ms | inter-token p50 ms | latency p50 ms | errors |", "|---|---|---|---|---|"]
        lines += [f"| {r['clients']} | {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | {r.get('itl_p50_ms', 0):.2f} | "
                  f"{r['latency_p50_ms']:.1f} | {r['errors']} |" for r in c["streaming"]]
    lines += ["", "| clients | continuous tokens/s (vs 1 client) | static tokens/s | TTFT p50 / p99 ms (cont.) | "
                  "per-token p50 / p99 ms (cont.) | TTFT p50 / p99 ms (static) | errors cont. / static |",
              "|---|---|---|---|---|---|---|"]
    for rc, rs in zip(c["load"], s["load"]):
        lines.append(f"| {rc['clients']} | {rc['tokens_per_s']:.0f} ({rc.get('vs_1_client', 0):.2f}x) | "
                     f"{rs['tokens_per_s']:.0f} | {rc['ttft_p50_ms']:.1f} / {rc['ttft_p99_ms']:.1f} | "
                     f"{rc['tpot_p50_ms']:.2f} / {rc['tpot_p99_ms']:.2f} | {rs['ttft_p50_ms']:.1f} / "
                     f"{rs['ttft_p99_ms']:.1f} | {rc['errors']} / {rs['errors']} |")
    return lines
