"""Where `make data`'s tasks run: local processes (one per core by default) or Ray tasks on a cluster. Both call the
same function (training/data/shards.py `run`) with the same task dicts, so both write the same bytes; results come
back in task order. A ConfigError raised in a worker (a file that is not UTF-8, a bad JSON line) is raised here."""
from __future__ import annotations

import os
import time
import multiprocessing

from core.errors import ConfigError
from core.cluster import init_ray


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


def make(kind: str, workers: int, ray_address: str = ""):
    return RayEngine(workers, ray_address) if kind == "ray" else LocalEngine(workers or cores())


class _Progress:
    """A line at most every 10 s while a pass runs, and one when it ends (bytes of input done, MB/s, ETA)."""

    def __init__(self, what: str, tasks: list[dict], log):
        self.what, self.log, self.t0, self.last = what, log, time.time(), time.time()
        self.total, self.done, self.n = sum(t["piece"]["size"] for t in tasks), 0, len(tasks)
        self.finished = 0

    def step(self, task: dict) -> None:
        self.done += task["piece"]["size"]
        self.finished += 1
        now = time.time()
        if now - self.last >= 10 or self.finished == self.n:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / rate if rate else 0
            self.log(f"data: {self.what} {self.finished}/{self.n} pieces, {self.done / 1e6:,.1f}/"
                     f"{self.total / 1e6:,.1f} MB, {rate / 1e6:.2f} MB/s" + (f", ETA {eta:.0f}s" if eta >= 1 else ""))


class LocalEngine:
    """A pool of `workers` processes, started at the first parallel pass and kept for the next (the vocabulary and
    tokenize passes share it: one start-up, not two); `close()` ends it."""

    def __init__(self, workers: int):
        self.workers, self.pool = workers, None

    def describe(self) -> str:
        return f"local x{self.workers}"

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None

    def run(self, tasks: list[dict], what: str, log) -> list[dict]:
        from training.data import shards

        if not tasks:
            return []
        progress, results = _Progress(what, tasks, log), {}
        order = sorted(range(len(tasks)), key=lambda i: -tasks[i]["piece"]["size"])  # (largest first: balance)
        if self.workers == 1 or len(tasks) == 1:
            for i in order:
                results[i] = shards.run(tasks[i])
                progress.step(tasks[i])
            return [results[i] for i in range(len(tasks))]
        if self.pool is None:
            # spawn: a worker starts clean (no inherited threads or locks from the caller, e.g. MLflow's)
            self.pool = multiprocessing.get_context("spawn").Pool(self.workers, shards.single_threaded)
        for i, result in self.pool.imap_unordered(_indexed, [(i, tasks[i]) for i in order]):
            results[i] = result
            progress.step(tasks[i])
        return [results[i] for i in range(len(tasks))]


def _indexed(item):
    from training.data import shards

    i, task = item
    return i, shards.run(task)


class RayEngine:
    """Ray tasks, one per piece, each writing its own shard to storage that the driver and every Ray node share
    (the data root must be such a path). `ray_address` "" starts a local Ray instance with `workers` CPUs."""

    def __init__(self, workers: int, address: str):
        self.workers, self.address = workers, address

    def describe(self) -> str:
        return f"ray {self.address or 'local'}" + (f" x{self.workers}" if self.workers else "")

    def close(self) -> None:
        pass  # (a local Ray instance ends with this process; a cluster's stays up)

    def run(self, tasks: list[dict], what: str, log) -> list[dict]:
        if not tasks:
            return []
        from training.data import shards

        ray = init_ray(self.address, self.workers or cores())

        remote = ray.remote(num_cpus=1, max_retries=2)(shards.run)
        progress, results = _Progress(what, tasks, log), {}
        pending = {remote.remote(task): i for i, task in enumerate(tasks)}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(done[0])
            try:
                results[i] = ray.get(done[0])
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                raise (cause if isinstance(cause, ConfigError) else exc) from None
            progress.step(tasks[i])
        return [results[i] for i in range(len(tasks))]
