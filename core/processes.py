"""Process helpers: /proc readers, ports, signals to process trees, background server groups."""
from __future__ import annotations

import socket
from pathlib import Path
import ctypes
import json
import os
import subprocess
import sys
import time


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, ...; start time is index 19),
    or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _all_stats():
    for entry in Path("/proc").glob("[0-9]*"):
        fields = proc_stat(entry.name)
        if fields:
            yield int(entry.name), fields


def group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process in the group? (Zombies can linger where PID 1 does not reap orphans.)"""
    return any(int(fields[2]) == pgid and fields[0] != "Z" for _, fields in _all_stats())


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports nothing listens on right now (the OS may hand the same free port out twice in a row)."""
    chosen: list[int] = []
    while len(chosen) < n:
        port = free_port(host)
        if port not in chosen:
            chosen.append(port)
    return chosen


def children_map() -> dict[int, list[int]]:
    """parent pid -> child pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for pid, fields in _all_stats():
        tree.setdefault(int(fields[1]), []).append(pid)
    return tree


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first), including those that started their own session."""
    tree, out, todo = children_map(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def signal_pids(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def wait_gone(pids, timeout_s: float) -> bool:
    """Wait until none of `pids` is alive (gone or a zombie; signals are delivered asynchronously); False at the
    timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if (proc_stat(pid) or ["Z"])[0] != "Z"]
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.02)


def die_with_parent(sig: int = 15):
    """Ask Linux to send `sig` to this process when its parent exits (prctl PR_SET_PDEATHSIG), so that a launcher
    killed with SIGKILL leaves no child running. No-op off Linux."""
    parent = os.getppid()
    _prctl_pdeathsig(sig)
    if os.getppid() != parent:  # the parent exited before prctl took effect
        os.kill(os.getpid(), sig)


def _resolve_prctl():
    if not sys.platform.startswith("linux"):
        return lambda sig: None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved in the parent: nothing to load after fork
    return lambda sig: prctl(1, sig)  # PR_SET_PDEATHSIG = 1


_prctl_pdeathsig = _resolve_prctl()


def child_dies_with_parent(sig: int = 15):
    """A Popen `preexec_fn`: the child gets `sig` when this process exits (see die_with_parent)."""
    return lambda: _prctl_pdeathsig(sig)


# ---------------------------------------------------------------------------------------------------------------------
# Background servers (the serving endpoint, the MLflow server): one process group each, started, polled, stopped.

def start_group(cmd: list[str], log_file: Path, cwd: Path, env: dict):
    """Start `cmd` in its own session (so its whole process tree can be signalled), output appended to log_file."""
    with open(log_file, "ab") as log:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def wait_ready(proc, ready, timeout_s: float, poll_s: float = 0.5) -> str:
    """Poll `ready()` (exceptions count as not ready) until it is true: "ready", "exited" (the process died) or
    "timeout"."""
    deadline = time.time() + timeout_s
    while True:
        if proc.poll() is not None:
            return "exited"
        try:
            if ready():
                return "ready"
        except Exception:  # noqa: BLE001  (connection errors while the server comes up)
            pass
        if time.time() > deadline:
            return "timeout"
        time.sleep(poll_s)


def stop_group(pgid: int, steps=((2, 15.0), (9, 10.0))) -> None:
    """Send each (signal, wait seconds) of `steps` to the group while anything in it lives."""
    for sig, wait_s in steps:
        if not group_alive(pgid):
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + wait_s
        while group_alive(pgid) and time.time() < deadline:
            time.sleep(0.2)


def log_tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop_recorded(state_file: Path, steps=((15, 15.0), (9, 10.0))) -> bool:
    """Stop the process group whose pid the JSON `state_file` records (SIGTERM, then SIGKILL), and remove the file;
    False if nothing was recorded."""
    if not state_file.exists():
        return False
    stop_group(json.loads(state_file.read_text())["pid"], steps)
    state_file.unlink(missing_ok=True)
    return True
