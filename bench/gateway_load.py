"""The gateway's cost (docs/gateway.md): the same export served by two replicas behind nginx (make gateway's
configuration, a key), against one replica reached directly, in the same run. The two replicas share the machine:
each runs half its cores' generation workers (serving.workers), as two replicas on one host should; the direct
replica runs the default (one worker per core).

    overhead    1 client, one-token completions: direct to replica 1 and through the gateway, interleaved request
                by request; p50 / p99 of each and the difference
    throughput  32 closed-loop streaming clients (serving_load.stream_ttft): through the gateway to the two replicas,
                and direct to the default replica, alternating rounds; tokens/s of each, the ratio per round and of
                the medians
"""
from __future__ import annotations

import time
from pathlib import Path
import os

import numpy as np
import requests

from bench import between_trials
from bench.serving_load import PROMPTS, server_config, stream_ttft
from core import exportdir
from serving import controller
from serving.gateway import keys, nginx

CLIENTS = 32


def run(export_dir: Path, out: Path, quick: bool) -> dict:
    model = exportdir.read_meta(export_dir)["registered_model_name"]
    half = f"serving.workers={max(1, (os.cpu_count() or 2) // 2)}"
    configs = [server_config(half), server_config(half), server_config()]
    state_dirs = [out / f"serving-gateway-{i}" for i in (1, 2)] + [out / "serving-direct"]
    gateway = None
    try:
        states = [controller.start(c, export_dir, d, owner="bench") for c, d in zip(configs, state_dirs)]
        gateway = server_config(f"gateway.state_dir={out / 'gateway'}", f"gateway.keys_dir={out / 'gateway-keys'}",
                                "gateway.host=127.0.0.1",
                                f"gateway.backends=[{states[0]['api_url']}, {states[1]['api_url']}]")
        key = keys.create(keys.keys_dir(gateway), "bench", 10_000_000)
        url = nginx.start(gateway)["url"]
        headers = {"Authorization": f"Bearer {key}"}
        overhead = _overhead(states[0]["openai_base_url"], f"{url}/v1", headers, model, 20 if quick else 300)
        rounds = []
        for _ in range(1 if quick else 3):  # (alternating: both see the same machine)
            between_trials()
            through = stream_ttft({"openai_base_url": f"{url}/v1"}, model, CLIENTS, 3 if quick else 15,
                                  headers=headers)
            direct = stream_ttft(states[2], model, CLIENTS, 3 if quick else 15)
            rounds.append({"gateway_two_replicas": through, "direct_one_replica": direct,
                           "ratio": through["tokens_per_s"] / max(direct["tokens_per_s"], 1e-9)})
    finally:
        if gateway is not None:
            nginx.stop(gateway)
        for d in state_dirs:
            controller.stop(d)
    median = lambda key: float(np.median([r[key]["tokens_per_s"] for r in rounds]))  # noqa: E731
    return {"overhead": overhead, "rounds": rounds, "clients": CLIENTS,
            "tokens_per_s": {"gateway_two_replicas": median("gateway_two_replicas"),
                             "direct_one_replica": median("direct_one_replica")},
            "ratio_of_medians": median("gateway_two_replicas") / max(median("direct_one_replica"), 1e-9)}


def _overhead(direct: str, through: str, headers: dict, model: str, count: int) -> dict:
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0}
    sessions = {"direct": (requests.Session(), direct, {}), "gateway": (requests.Session(), through, headers)}
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(count):
        for name, (session, base, extra) in sessions.items():
            t0 = time.perf_counter()
            session.post(f"{base}/completions", json=body, headers=extra, timeout=30).raise_for_status()
            times[name].append(time.perf_counter() - t0)
    ms = {name: {"p50_ms": float(np.percentile(v, 50) * 1000), "p99_ms": float(np.percentile(v, 99) * 1000)}
          for name, v in times.items()}
    return {**ms, "added_p50_ms": ms["gateway"]["p50_ms"] - ms["direct"]["p50_ms"],
            "added_p99_ms": ms["gateway"]["p99_ms"] - ms["direct"]["p99_ms"], "requests_each": count}


def markdown(g: dict) -> list[str]:
    o = g["overhead"]
    lines = ["## Gateway (nginx, two replicas)", "",
             f"1 client, one-token completions, interleaved ({o['requests_each']} each): direct p50 "
             f"{o['direct']['p50_ms']:.2f} ms / p99 {o['direct']['p99_ms']:.2f} ms; through the gateway p50 "
             f"{o['gateway']['p50_ms']:.2f} ms / p99 {o['gateway']['p99_ms']:.2f} ms (added p50 "
             f"{o['added_p50_ms']:+.2f} ms, p99 {o['added_p99_ms']:+.2f} ms)", "",
             f"| round | gateway, two replicas (tok/s) | direct, one replica (tok/s) | ratio |", "|---|---|---|---|"]
    for i, r in enumerate(g["rounds"], 1):
        lines.append(f"| {i} | {r['gateway_two_replicas']['tokens_per_s']:.0f} | "
                     f"{r['direct_one_replica']['tokens_per_s']:.0f} | {r['ratio']:.2f} |")
    lines += ["", f"{g['clients']} streaming clients: ratio of medians {g['ratio_of_medians']:.2f}", ""]
    return lines
