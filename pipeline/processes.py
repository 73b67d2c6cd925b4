"""Background-process helpers shared by the serving endpoint and the MLflow server."""
from __future__ import annotations

import socket
from pathlib import Path


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
    import os

    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def die_with_parent(sig: int = 15):
    """Ask Linux to send `sig` to this process when its parent exits (prctl PR_SET_PDEATHSIG), so that a launcher
    killed with SIGKILL leaves no child running. No-op off Linux."""
    import os

    parent = os.getppid()
    _prctl_pdeathsig(sig)
    if os.getppid() != parent:  # the parent exited before prctl took effect
        os.kill(os.getpid(), sig)


def _resolve_prctl():
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return lambda sig: None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved in the parent: nothing to load after fork
    return lambda sig: prctl(1, sig)  # PR_SET_PDEATHSIG = 1


_prctl_pdeathsig = _resolve_prctl()


def child_dies_with_parent(sig: int = 15):
    """A Popen `preexec_fn`: the child gets `sig` when this process exits (see die_with_parent)."""
    return lambda: _prctl_pdeathsig(sig)
