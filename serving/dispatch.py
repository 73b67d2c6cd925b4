"""The server's side of the generation workers: hand each request to one, wait for its answer within its deadline,
and keep the workers running.

- **Workers**: `serving.workers` processes (0 = one per core), each with its own predictors and continuous-batching
  scheduler (serving/worker.py). A request goes to the ready worker with the fewest requests in flight.
- **Bounded**: at most `max_batch_size + max_queue` requests in flight per worker; one more is refused at once
  (busy).
- **Deadlines**: a request not answered within its deadline (`serving.request_timeout_s`) gets a deadline error and
  is cancelled in its worker (it leaves the queue or the running batch).
- **A dead worker is replaced**: its socket closes the moment it dies; every request it held gets a worker-died
  error at once, and a new worker is started; the others keep serving. Readiness is false only while no worker is
  ready. More than `max_worker_restarts` deaths within `restart_window_s` is fatal: `on_fatal` gets the reason (the
  server then exits non-zero, so that its supervisor restarts it) -- never a live server that serves nothing.
- **Drain**: no new requests; the ones in flight finish (up to a grace period); then the workers stop.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from core import REPO_ROOT
from core.exportdir import Placement
from core.processes import child_dies_with_parent
from serving.generation import GenerationSettings
from serving.state import WORKER_FILE

CODES = {"bad_request": 8001, "internal": 8002, "busy": 8003, "deadline": 8004, "worker_died": 8005,
         "unavailable": 8006}


class ServingError(Exception):
    """A request that cannot be answered: `kind` is one of CODES (err_no for Paddle Serving, an HTTP status for the
    OpenAI-compatible route)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind, self.message, self.code = kind, message, CODES[kind]


@dataclass
class _Pending:
    done: threading.Event = field(default_factory=threading.Event)
    result: dict | None = None
    error: ServingError | None = None


class WorkerHandle:
    """One worker process: started and read by its own manager thread (which must outlive the process: the
    worker's parent-death signal follows the thread that started it)."""

    def __init__(self, index: int, dispatcher: "Dispatcher"):
        self.index, self.dispatcher = index, dispatcher
        self.pending: dict[int, _Pending] = {}
        self.ready = threading.Event()
        self.conn: Connection | None = None
        self.proc: subprocess.Popen | None = None
        self.send_lock = threading.Lock()
        self.info: dict = {}
        self.queue_state = (0, 0)

    def manage(self) -> None:
        d = self.dispatcher
        while not d.stopping:
            try:
                self._spawn()
                self._read()
            except Exception as exc:  # noqa: BLE001  (counted as a death: the process is ended, then replaced)
                d.log(f"generation worker {self.index} failed: {exc.__class__.__name__}: {exc}")
                if self.proc and self.proc.poll() is None:
                    self.proc.kill()
            if d.stopping or not d.worker_died(self):
                return

    def _spawn(self) -> None:
        d, s = self.dispatcher, self.dispatcher.settings
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "serving.worker", "--model", str(d.model_dir), "--fd", str(theirs.fileno()),
               "--threads", str(d.threads), "--generation", s.generation, "--max-batch-size",
               str(s.max_batch_size), "--max-batch-tokens", str(s.max_batch_tokens), "--policy", s.scheduler,
               *placement_args(d.placements[self.index % len(d.placements)])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                                     preexec_fn=child_dies_with_parent())
        theirs.close()
        self.conn = Connection(ours.detach())

    def _read(self) -> None:
        d = self.dispatcher
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            if message[0] == "ready":
                self.info = {**message[1], "started_at": time.time()}
                self.ready.set()
                d.worker_ready(self)
            elif message[0] == "state":
                self.queue_state = message[1:]
                d.update_gauges()
            else:
                self.resolve(message)

    def send(self, *message) -> None:
        try:
            with self.send_lock:
                self.conn.send(message)
        except (OSError, AttributeError):
            pass  # (the worker is gone: its death fails the request)

    def resolve(self, message) -> None:
        pending = self.forget(message[1])
        if pending is None:
            return  # (already answered: deadline)
        if message[0] == "done":
            pending.result = message[2]
        else:
            pending.error = ServingError(message[2], message[3])
        pending.done.set()

    def forget(self, job_id: int) -> _Pending | None:
        with self.dispatcher.lock:
            pending = self.pending.pop(job_id, None)
        self.dispatcher.update_gauges()
        return pending

    def fail_all(self, error: ServingError) -> int:
        with self.dispatcher.lock:
            held, self.pending = self.pending, {}
        for pending in held.values():
            pending.error = error
            pending.done.set()
        return len(held)

    def stop(self) -> None:
        self.send("stop")
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def placement_args(placement: Placement) -> list[str]:
    """serving/worker.py's options for where its predictors run."""
    return ["--device", placement.device, "--device-id", str(placement.device_id), "--gpu-memory-mb",
            str(placement.memory_mb), "--precision", placement.precision]


class Dispatcher:
    def __init__(self, serving_config, model_dir: Path, threads: int, workers: int = 1, metrics=None,
                 state_dir: Path | None = None, on_fatal=None, log=None):
        s = serving_config
        self.settings, self.model_dir, self.threads, self.metrics = s, Path(model_dir), threads, metrics
        self.capacity = s.max_batch_size + s.max_queue  # per worker
        self.state_dir, self.on_fatal = state_dir, on_fatal or (lambda reason: None)
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.draining, self.stopping, self.fatal = False, False, ""
        self.deaths: deque[float] = deque()
        self.workers = [WorkerHandle(i, self) for i in range(workers)]
        from serving.placement import placements

        self.placements = placements(s) if s.device == "gpu" else [Placement()]
        self.meta: dict = {}

    def start(self) -> None:
        for worker in self.workers:
            threading.Thread(target=worker.manage, name=f"worker-{worker.index}", daemon=True).start()

    @property
    def ready(self) -> bool:
        return any(w.ready.is_set() for w in self.workers) and not self.draining and not self.fatal

    @property
    def in_flight(self) -> int:
        with self.lock:
            return sum(len(w.pending) for w in self.workers)

    # -- the workers' lives -----------------------------------------------------------------------------------------
    def worker_ready(self, worker: WorkerHandle) -> None:
        worker.info["restarts"] = len(self.deaths)
        self._write_worker_file()
        self.update_gauges()
        info = worker.info
        self.log(f"generation worker {worker.index} ready: pid {info['pid']}, loaded in {info['load_s']}s, "
                 f"{info['rss_mb']} MB")

    def worker_died(self, worker: WorkerHandle) -> bool:
        """Fail what it held, then start another (True) or give up (False: fatal)."""
        worker.ready.clear()
        code = worker.proc.wait() if worker.proc else None
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        failed = worker.fail_all(ServingError("worker_died", f"the generation worker died ({how}) while generating "
                                                             "this request; the server is starting a new one: retry"))
        self.update_gauges()
        now = time.monotonic()
        with self.lock:
            self.deaths.append(now)
            while self.deaths and now - self.deaths[0] > self.settings.restart_window_s:
                self.deaths.popleft()
            deaths = len(self.deaths)
        if self.metrics:
            self.metrics.worker_restarts.inc()
        self.log(f"generation worker {worker.index} died ({how}); {failed} request(s) failed; restarting it "
                 f"({deaths} death(s) in the last {self.settings.restart_window_s:g}s)")
        if deaths > self.settings.max_worker_restarts:
            self.fatal = (f"generation workers died {deaths} times within {self.settings.restart_window_s:g}s "
                          f"(last: {how}); giving up")
            self.on_fatal(self.fatal)
            return False
        return True

    def _write_worker_file(self) -> None:
        """worker.json, written whole (tmp + rename) under the lock: workers become ready at the same moment."""
        if not self.state_dir:
            return
        with self.lock:
            info = {"workers": [dict(w.info, index=w.index) for w in self.workers if w.ready.is_set()],
                    "restarts": len(self.deaths)}
            tmp = self.state_dir / f".{WORKER_FILE}.tmp"
            try:
                tmp.write_text(json.dumps(info))
                os.replace(tmp, self.state_dir / WORKER_FILE)
            except OSError as exc:  # (a full disk must not cost a worker)
                self.log(f"could not write {self.state_dir / WORKER_FILE}: {exc}")

    def update_gauges(self) -> None:
        if not self.metrics:
            return
        self.metrics.ready.set(1 if self.ready else 0)
        self.metrics.in_flight.set(self.in_flight)
        self.metrics.queue_depth.set(sum(w.queue_state[0] for w in self.workers))
        self.metrics.running_batch.set(sum(w.queue_state[1] for w in self.workers))

    # -- requests -------------------------------------------------------------------------------------------------
    def generate(self, prompt: str, settings: GenerationSettings, timeout_s: float | None = None) -> dict:
        """The worker's result for one request, or ServingError."""
        timeout_s = timeout_s or self.settings.request_timeout_s
        deadline = time.monotonic() + timeout_s
        if self.draining or self.fatal:
            raise ServingError("unavailable", "the server is shutting down")
        pending = _Pending()
        with self.lock:
            ready = [w for w in self.workers if w.ready.is_set()]
            if not ready:
                raise ServingError("unavailable", "no generation worker is ready (starting, or restarting after a "
                                                  "failure); retry shortly")
            worker = min(ready, key=lambda w: len(w.pending))
            if len(worker.pending) >= self.capacity:
                raise ServingError("busy", f"server busy: {self.capacity * len(ready)} requests in flight (serving."
                                           "max_batch_size + serving.max_queue per worker); retry later")
            job_id = next(self.ids)
            worker.pending[job_id] = pending
        self.update_gauges()
        worker.send("generate", job_id, prompt, settings, deadline)
        if not pending.done.wait(timeout_s):
            worker.forget(job_id)
            worker.send("cancel", job_id)
            raise ServingError("deadline", f"deadline exceeded: no answer within {timeout_s:g}s "
                                           f"(serving.request_timeout_s)")
        if pending.error:
            raise pending.error
        return pending.result

    # -- shutting down --------------------------------------------------------------------------------------------
    def drain(self, grace_s: float) -> bool:
        """Refuse new requests, let those in flight finish (up to grace_s), stop the workers. True if all finished."""
        self.draining = True
        self.update_gauges()
        deadline = time.monotonic() + grace_s
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        finished = not self.in_flight
        self.stop()
        return finished

    def stop(self) -> None:
        self.stopping = True
        for worker in self.workers:
            worker.stop()
