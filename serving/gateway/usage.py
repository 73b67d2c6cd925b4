"""The usage table: per consumer, requests answered (2xx) and refused for rate (429: the gateway's per-key
requests per minute, or a replica's tokens-per-minute budget) from the gateway's access log, and prompt and
completion tokens from the replicas' Prometheus metrics (serving_consumer_tokens_total: the answers' `usage`)."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def table(state_dir: Path, replicas: list[str]) -> tuple[dict[str, dict], list[str]]:
    rows: dict[str, dict] = defaultdict(lambda: {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                                 "rate_limited": 0})
    log = state_dir / "access.log"
    if log.is_file():
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            consumer = entry.get("consumer") or ""
            if not consumer or not entry.get("uri", "").startswith("/v1/"):
                continue
            if 200 <= int(entry["status"]) < 300:
                rows[consumer]["requests"] += 1
            elif int(entry["status"]) == 429:
                rows[consumer]["rate_limited"] += 1
    unreachable = []
    for url in replicas:
        try:
            samples = scrape(url)
        except OSError:
            unreachable.append(url)
            continue
        for labels, value in samples.get("serving_consumer_tokens_total", []):
            if labels.get("consumer") and labels["consumer"] != "direct":
                rows[labels["consumer"]][f"{labels['kind']}_tokens"] += int(value)
    return dict(rows), unreachable


def scrape(url: str) -> dict[str, list[tuple[dict, float]]]:
    """A replica's /metrics, parsed: {metric name: [(labels, value)]}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found: dict[str, list] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name].append((sample.labels, sample.value))
    return found


def format_table(rows: dict[str, dict]) -> str:
    header = f"{'consumer':<24} {'requests':>9} {'prompt_tokens':>14} {'completion_tokens':>18} {'429s':>6}"
    lines = [header] + [f"{name:<24} {r['requests']:>9} {r['prompt_tokens']:>14} {r['completion_tokens']:>18} "
                        f"{r['rate_limited']:>6}" for name, r in sorted(rows.items())]
    return "\n".join(lines) if rows else header + "\n(no requests through the gateway yet)"
