"""The usage table, from the gateway's access log alone: per consumer and model version, requests answered (2xx),
prompt and completion tokens (each answer's `usage`, which the replica hands the gateway: serving/protocol.py
USAGE_HEADER / USAGE_COMMENT) and requests refused for rate (429: the gateway's per-key requests per minute, or a
replica's tokens-per-minute budget; no model answered those: model "-").

nginx writes a request's line as its answer ends, so the table survives a replica's SIGKILL and the gateway's
restart (the log is appended to); a request retried on another replica is one line, with the usage of the replica
that answered. A stream cut short by a dying replica has no usage line: its tokens are not counted."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

NO_MODEL = "-"


def table(state_dir: Path) -> dict[tuple[str, str], dict]:
    """{(consumer, "name/version" or "-"): {requests, prompt_tokens, completion_tokens, rate_limited}}."""
    rows: dict[tuple[str, str], dict] = defaultdict(lambda: {"requests": 0, "prompt_tokens": 0,
                                                             "completion_tokens": 0, "rate_limited": 0})
    log = state_dir / "access.log"
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if log.is_file() else []:
        try:
            entry = json.loads(line)
        except ValueError:  # (a line cut by a full disk, say)
            continue
        consumer, status = entry.get("consumer") or "", int(entry.get("status", 0))
        if not consumer or not entry.get("uri", "").startswith("/v1/"):
            continue
        model = f"{entry['model']}/{entry.get('version', '')}" if entry.get("model") else NO_MODEL
        row = rows[consumer, model]
        if 200 <= status < 300:
            row["requests"] += 1
            prompt, _, completion = (entry.get("usage") or "").partition(" ")
            if prompt.isdigit() and completion.isdigit():
                row["prompt_tokens"] += int(prompt)
                row["completion_tokens"] += int(completion)
        elif status == 429:
            row["rate_limited"] += 1
    return dict(rows)


def format_table(rows: dict[tuple[str, str], dict]) -> str:
    header = (f"{'consumer':<24} {'model':<28} {'requests':>9} {'prompt_tokens':>14} {'completion_tokens':>18} "
              f"{'429s':>6}")
    lines = [header] + [f"{name:<24} {model:<28} {r['requests']:>9} {r['prompt_tokens']:>14} "
                        f"{r['completion_tokens']:>18} {r['rate_limited']:>6}"
                        for (name, model), r in sorted(rows.items())]
    return "\n".join(lines) if rows else header + "\n(no requests through the gateway yet)"
