"""Why a run failed, in one line: which rank failed first (from every rank's log), and the failures users hit most
(disk full, out of memory, a rank killed from outside) with the next step to take."""
from __future__ import annotations

import re
import sys
import shutil
from pathlib import Path

from core.layout import ParallelLayout
from training.checkpoint.local import latest_complete, remove_partial

LOG_TAIL_LINES = 40

_PEER_LOST = re.compile(r"TIMEOUT|IoException|Connection (?:reset|closed) by peer|Connection refused")
_PAIR_RANK = re.compile(r"pair_rank = (\d+)")
_ERROR = re.compile(r"Traceback|Error|terminate called|Termination signal|TIMEOUT")


def rank_logs(log_dir: Path, procs_per_node: int = 1) -> dict[int, Path]:
    """global rank -> its log: `workerlog.<rank>`, or on several nodes `node<k>/workerlog.<local rank>` (the launcher
    numbers logs per node; ranks are numbered node by node)."""
    def numbered(folder: Path) -> dict[int, Path]:
        return {int(p.suffix[1:]): p for p in folder.glob("workerlog.*") if p.suffix[1:].isdigit()}

    found = numbered(log_dir)
    for folder in log_dir.glob("node*"):
        if folder.name[4:].isdigit():
            found.update({int(folder.name[4:]) * procs_per_node + local: p for local, p in numbered(folder).items()})
    return found


def failing_rank(logs: dict[int, str]) -> tuple[int, str, str] | None:
    """(rank, why, log tail) of the rank that most likely failed first, from each rank's log text.

    A rank that raised its own Python exception is the culprit. A rank killed from outside (OOM killer, SIGKILL)
    writes nothing: its log just stops, while its peers fail with gloo errors (TIMEOUT, connection reset)."""
    if not logs:
        return None

    def tail(rank: int) -> str:
        return "\n".join(logs.get(rank, "").splitlines()[-LOG_TAIL_LINES:])

    own_error = [r for r, text in sorted(logs.items()) if "Traceback" in text and not _PEER_LOST.search(text)]
    if own_error:
        return own_error[0], "raised an exception", tail(own_error[0])
    peer_lost = {r: _PEER_LOST.search(text) for r, text in logs.items() if _PEER_LOST.search(text)}
    silent = [r for r, text in sorted(logs.items()) if not _ERROR.search(text)]
    if peer_lost and silent:
        witness = min(peer_lost)
        line = next(l for l in logs[witness].splitlines() if peer_lost[witness].group(0) in l).strip()
        return silent[0], f"stopped without an error (killed?); rank {witness} then lost its peer: {line}", \
            tail(silent[0])
    for rank, text in sorted(logs.items()):
        pair = _PAIR_RANK.search(text)
        if pair:
            return int(pair.group(1)), f"was lost by rank {rank} ({pair.group(0)})", tail(int(pair.group(1)))
    errored = [r for r, text in sorted(logs.items()) if _ERROR.search(text)]
    rank = errored[0] if errored else 0
    return rank, "reported an error" if errored else "exited non-zero", tail(rank)


_DISK_FULL = re.compile(r"No space left on device|StorageFull|Errno 28|ENOSPC")
_OUT_OF_MEMORY = re.compile(r"Out of memory|out of memory|MemoryError|ResourceExhaustedError|Cannot allocate memory")


def diagnose(run_dir: Path, layout: ParallelLayout, rank: int, why: str, logs: dict[int, str]) -> tuple[str, str]:
    """(kind, one line with the next step) for the failures users hit most; ("", "") for anything else.

    Disk full: the partial checkpoints (newer than the latest complete one; the ranks are gone, so nothing writes
    them) are removed so the disk is not left full, and the line names the free space and the RESUME command."""
    latest = latest_complete(run_dir)
    usage = shutil.disk_usage(run_dir)
    needed = sum(p.stat().st_size for p in latest.rglob("*") if p.is_file()) if latest else 0
    # (the ranks' own words, or -- when the full disk kept them from being logged -- less room than a checkpoint)
    if any(_DISK_FULL.search(text) for text in logs.values()) or usage.free < needed:
        partial = remove_partial(run_dir)
        usage = shutil.disk_usage(run_dir)
        removed = f"removed the partial {', '.join(p.name for p in partial)}; " if partial else ""
        return "disk_full", (
            f"disk full: no space left on the file system of {run_dir} ({usage.free / 2**20:.0f} MiB free of "
            f"{usage.total / 2**30:.1f} GiB); {removed}latest complete checkpoint: {latest or 'none'}; free space "
            f"(or lower training.keep_checkpoints), then continue with: make train RESUME={run_dir}")
    text = logs.get(rank, "")
    if _OUT_OF_MEMORY.search(text):
        return "out_of_memory", (
            f"out of memory: rank {rank} of layout {layout.name} ({layout.device}) could not allocate; see the "
            f"estimate per device with `make plan CONFIG=<this config>` and lower parallel.micro_batch_size, turn on "
            f"parallel.recompute or raise the tensor/pipeline/sharding degrees")
    if why.startswith(("stopped without an error", "was lost by rank")):
        return "killed", (f"rank {rank} stopped without an error of its own: killed from outside (SIGKILL, often the "
                          f"kernel's out-of-memory killer: see `dmesg`; `make plan` estimates memory per device) or "
                          f"its node was lost; continue with: make train RESUME={run_dir}")
    return "", ""


def explain(run_dir: Path, layout: ParallelLayout) -> dict | None:
    """The failing rank, why, its log tail and the one-line diagnosis (kind and next step), printed on stderr; None
    when no rank wrote a log. Read from the logs of every node (node<k>/ subfolders) under run_dir/logs."""
    paths = rank_logs(run_dir / "logs", layout.procs_per_node)
    logs = {rank: path.read_text(errors="replace") for rank, path in paths.items()}
    found = failing_rank(logs)
    if not found:
        print("training failed before any rank wrote a log", file=sys.stderr)
        return None
    rank, why, tail = found
    print(f"\ntraining failed: rank {rank} {why}\nlast lines of {paths.get(rank, run_dir / 'logs')}:\n{tail}\n",
          file=sys.stderr, flush=True)
    kind, line = diagnose(run_dir, layout, rank, why, logs)
    if line:
        print(line, file=sys.stderr, flush=True)
    return {"rank": rank, "why": why, "tail": tail, "kind": kind}
