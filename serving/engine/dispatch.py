"""The server's side of the generation workers: hand each request to one, wait for its answer within its deadline,
and keep the workers running.

- **Workers**: `serving.workers` processes (0 = one per core), each with its own predictors and continuous-batching
  scheduler (serving/engine/worker.py). A request goes to the ready worker with the fewest requests in flight.
- **Bounded**: at most `max_batch_size + max_queue` requests in flight per worker; one more is refused at once
  (busy).
- **Deadlines**: a request not answered within its deadline (`serving.request_timeout_s`) gets a deadline error and
  is cancelled in its worker (it leaves the queue or the running batch).
- **A dead worker is replaced**: its socket closes the moment it dies; every request it held gets a worker-died
  error at once, and a new worker is started; the others keep serving. Readiness is false only while no worker is
  ready. More than `max_worker_restarts` deaths within `restart_window_s` is fatal: `on_fatal` gets the reason (the
  server then exits non-zero, so that its supervisor restarts it) -- never a live server that serves nothing.
- **Drain**: no new requests; the ones in flight finish (up to a grace period); then the workers stop.
- **Switch** (`switch`: another export directory, e.g. when a registry alias moves): a new set of workers loads the
  new model beside the old ones; once every one of them is ready, new requests go to them and the old workers stop
  after answering what they hold; if one fails to load, the switch is abandoned and the old model keeps serving.
  Every result carries the lineage of the worker's model (`lineage`), so each answer names its version.
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
from serving.engine.runtime import Placement
from core.files import atomic_write
from serving.engine.exported import lineage
from serving.protocol import GenerationSettings
from serving.state import WORKER_FILE

from serving.protocol import RequestError
from core import exportdir
from core.errors import ConfigError
from serving.engine.placement import placements
from serving.engine.affinity import Affinity, choose, text_chain



@dataclass
class _Pending:
    done: threading.Event = field(default_factory=threading.Event)
    result: dict | None = None
    error: RequestError | None = None
    # called on the worker's reader thread with ("delta", {"text", "logprobs"}), then ("done", result) or
    # ("error", RequestError)
    on_event: object = None

    on_done: object = None  # (the dispatcher's) called with the result of a finished request

    def finish(self, result: dict | None = None, error: RequestError | None = None) -> None:
        self.result, self.error = result, error
        if result is not None and self.on_done:
            self.on_done(result)
        self.done.set()
        if self.on_event:
            self.on_event(("done", result) if error is None else ("error", error))


@dataclass
class Ticket:
    """A submitted request: which worker holds it, under which id."""
    worker: "WorkerHandle"
    job_id: int
    pending: _Pending


class WorkerHandle:
    """One worker process: started and read by its own manager thread (which must outlive the process: the
    worker's parent-death signal follows the thread that started it)."""

    def __init__(self, index: int, dispatcher: "Dispatcher", model_dir: Path, meta: dict, standby: bool = False):
        self.index, self.dispatcher = index, dispatcher
        self.model_dir, self.lineage = Path(model_dir), lineage(meta) if meta else {}
        # standby: loading for a switch (not routed to; a death abandons the switch instead of a restart);
        # retired: replaced by a switch (answers what it holds, then stops; never restarted)
        self.standby, self.retired, self.failed = standby, False, threading.Event()
        self.pending: dict[int, _Pending] = {}
        self.ready = threading.Event()
        self.conn: Connection | None = None
        self.proc: subprocess.Popen | None = None
        self.send_lock, self.spawn_lock = threading.Lock(), threading.Lock()
        self.info: dict = {}
        self.queue_state = (0, 0)

    def manage(self) -> None:
        d = self.dispatcher
        while not d.stopping and not self.retired:
            try:
                with self.spawn_lock:  # (retire() under the same lock: a retired handle never spawns late)
                    if d.stopping or self.retired:
                        return
                    self._spawn()
                self._read()
            except Exception as exc:  # noqa: BLE001  (counted as a death: the process is ended, then replaced)
                d.log(f"generation worker {self.index} failed: {exc.__class__.__name__}: {exc}")
                if self.proc and self.proc.poll() is None:
                    self.proc.kill()
            if self.standby and not self.retired:
                self.failed.set()  # (a model that cannot load: the switch is abandoned, not retried)
                return
            if d.stopping or self.retired or not d.worker_died(self):
                return

    def _spawn(self) -> None:
        d, s = self.dispatcher, self.dispatcher.settings
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "serving.engine.worker", "--model", str(self.model_dir), "--fd", str(theirs.fileno()),
               "--threads", str(d.threads), "--generation", s.generation, "--max-batch-size",
               str(s.max_batch_size), "--max-batch-tokens", str(s.max_batch_tokens), "--policy", s.scheduler,
               *(["--mask-thread"] if s.mask_thread else []), "--prefix-cache-mb", str(s.prefix_cache_mb),
               "--prefix-block-tokens", str(s.prefix_block_tokens),
               *placement_args(d.placements[self.index % len(d.placements)])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        # (no preexec_fn: the worker asks for its own parent-death signal first thing, serving/engine/worker.py. A
        # preexec_fn makes Python fork() instead of vfork(), which runs gRPC's fork handlers in the child while the
        # server's gRPC threads are busy: the new worker aborted (SIGABRT, "epoll_wait error: Bad file descriptor")
        # before exec, seen in make test; vfork runs no fork handlers)
        self.proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
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
            elif message[0] == "deltas":  # (one step's new text of every streaming job)
                for job_id, delta in message[1]:
                    pending = self.pending.get(job_id)
                    if pending is not None and pending.on_event:
                        pending.on_event(("delta", delta))
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
            pending.finish(result={**message[2], "lineage": self.lineage})
        else:
            pending.finish(error=RequestError(message[2], message[3]))

    def forget(self, job_id: int) -> _Pending | None:
        with self.dispatcher.lock:
            pending = self.pending.pop(job_id, None)
        self.dispatcher.update_gauges()
        return pending

    def fail_all(self, error: RequestError) -> int:
        with self.dispatcher.lock:
            held, self.pending = self.pending, {}
        for pending in held.values():
            pending.finish(error=error)
        return len(held)

    def retire(self) -> None:
        """Never (re)started from now on: a process already spawned is left to `stop`."""
        with self.spawn_lock:
            self.retired = True

    def stop(self) -> None:
        self.send("stop")
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


MIN_CAPACITY = 128  # requests the server admits at least, by default (TGI's default is 128; vLLM queues all)


def per_worker_capacity(serving_config, workers: int) -> int:
    """Requests one worker holds at most: its running batch and its queue (serving.max_queue, or -1: whatever makes
    the server admit MIN_CAPACITY; each request's deadline bounds its wait)."""
    s = serving_config
    queue = s.max_queue if s.max_queue >= 0 else max(0, -(-MIN_CAPACITY // max(workers, 1)) - s.max_batch_size)
    return s.max_batch_size + queue


def placement_args(placement: Placement) -> list[str]:
    """serving/engine/worker.py's options for where its predictors run."""
    return ["--device", placement.device, "--device-id", str(placement.device_id), "--gpu-memory-mb",
            str(placement.memory_mb), "--precision", placement.precision]


class Dispatcher:
    def __init__(self, serving_config, model_dir: Path, threads: int, workers: int = 1, metrics=None,
                 state_dir: Path | None = None, on_fatal=None, log=None):
        s = serving_config
        self.settings, self.model_dir, self.threads, self.metrics = s, Path(model_dir), threads, metrics
        self.capacity = per_worker_capacity(s, workers)
        self.state_dir, self.on_fatal = state_dir, on_fatal or (lambda reason: None)
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.draining, self.stopping, self.fatal = False, False, ""
        self.deaths: deque[float] = deque()
        # (prefix caching) which worker holds which prompts, and how much busier than the least busy it may be and
        # still be chosen for them
        self.affinity, self.overloaded = Affinity(), max(2, s.max_batch_size // 4)

        self.meta: dict = _meta_of(self.model_dir)
        self.workers = [WorkerHandle(i, self, self.model_dir, self.meta) for i in range(workers)]
        self.retiring: list[WorkerHandle] = []
        self.switch_lock = threading.Lock()
        self.placements = placements(s) if s.device == "gpu" else [Placement()]

    def start(self, workers: list[WorkerHandle] | None = None) -> None:
        for worker in workers or self.workers:
            threading.Thread(target=worker.manage, name=f"worker-{worker.index}", daemon=True).start()

    @property
    def ready(self) -> bool:
        return any(w.ready.is_set() for w in self.workers) and not self.draining and not self.fatal

    @property
    def in_flight(self) -> int:
        with self.lock:
            return sum(len(w.pending) for w in [*self.workers, *self.retiring])

    # -- switching models -------------------------------------------------------------------------------------------
    def switch(self, model_dir: Path, load_timeout_s: float = 300.0) -> bool:
        """Serve `model_dir` from now on (see the module's docstring). Blocks until the new workers are ready (True)
        or one of them failed to load, or load_timeout_s passed (False: the current model keeps serving)."""
        model_dir = Path(model_dir)
        meta = exportdir.read_meta(model_dir)
        with self.switch_lock:
            if self.draining or self.stopping:
                return False
            new = [WorkerHandle(i, self, model_dir, meta, standby=True) for i in range(len(self.workers))]
            self.start(new)
            deadline = time.monotonic() + load_timeout_s
            while not all(w.ready.is_set() for w in new):
                if any(w.failed.is_set() for w in new) or time.monotonic() > deadline or self.stopping:
                    for w in new:
                        w.retire()
                        w.stop()
                    self.log(f"switch to {model_dir} abandoned: its workers did not all load; still serving "
                             f"{self.model_dir}")
                    return False
                time.sleep(0.05)
            with self.lock:
                old, self.workers = self.workers, new
                self.model_dir, self.meta = model_dir, meta
                for w in new:
                    w.standby = False
                for w in old:
                    w.retire()
                self.retiring.extend(old)
            self._write_worker_file()
            self.log(f"switched to {meta['registered_model_name']} v{meta['version']} ({model_dir}); "
                     f"{sum(len(w.pending) for w in old)} request(s) finish on the previous model")
        threading.Thread(target=self._retire, args=(old,), name="retire", daemon=True).start()
        return True

    def _retire(self, old: list[WorkerHandle]) -> None:
        """The replaced workers answer what they hold (each request's own deadline bounds it), then stop."""
        deadline = time.monotonic() + self.settings.request_timeout_s + 5
        while any(w.pending for w in old) and time.monotonic() < deadline:
            time.sleep(0.05)
        for w in old:
            w.stop()
            w.fail_all(RequestError("worker_died", "the previous model's worker stopped before answering; retry"))
        with self.lock:
            self.retiring = [w for w in self.retiring if w not in old]
            for w in old:
                self.affinity.forget(w)

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
        with self.lock:
            self.affinity.forget(worker)  # (its prefix cache died with it)
        code = worker.proc.wait() if worker.proc else None
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        failed = worker.fail_all(RequestError("worker_died", f"the generation worker died ({how}) while generating "
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
        """worker.json, written whole (core/files.py) under the lock: workers become ready at the same moment."""
        if not self.state_dir:
            return
        with self.lock:
            info = {"workers": [dict(w.info, index=w.index, model_dir=str(w.model_dir), **w.lineage)
                                for w in self.workers if w.ready.is_set()],
                    "restarts": len(self.deaths), "model_dir": str(self.model_dir)}
            try:
                atomic_write(self.state_dir / WORKER_FILE, json.dumps(info))
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
    def generate_choices(self, request) -> list[dict]:
        """The n choices of a protocol Request (serving/protocol.py), blocking: all within its deadline, or the
        first error (the other choices are cancelled)."""
        deadline = time.monotonic() + request.timeout_s
        tickets = []
        try:
            for i in range(request.n):
                tickets.append(self.submit(request.prompt, request.choice_settings(i), request.timeout_s,
                                           consumer=request.extra.get("consumer", "")))
            for ticket in tickets:
                if not ticket.pending.done.wait(max(0.0, deadline - time.monotonic())):
                    raise deadline_error(request.timeout_s)
                if ticket.pending.error:
                    raise ticket.pending.error
        except RequestError:
            for ticket in tickets:
                self.cancel(ticket)
            raise
        return [ticket.pending.result for ticket in tickets]

    def submit(self, prompt: str, settings: GenerationSettings, timeout_s: float | None = None, on_event=None,
               stream: bool = False, consumer: str = "") -> Ticket:
        """Hand one request to a ready worker (the least busy, or with prefix caching the one believed to hold the
        longest prefix of the prompt unless it is overloaded: serving/engine/affinity.py); its events go to
        `on_event` (on a reader thread); the caller waits and cancels (`cancel`) at its deadline or when its client
        is gone. `consumer`: who sent it (part of the prefix cache's key). RequestError: refused."""
        timeout_s = timeout_s or self.settings.request_timeout_s
        deadline = time.monotonic() + timeout_s
        if self.draining or self.fatal:
            raise RequestError("unavailable", "the server is shutting down")
        pending, s = _Pending(on_event=on_event), self.settings
        with self.lock:
            ready = [w for w in self.workers if w.ready.is_set()]
            if not ready:
                raise RequestError("unavailable", "no generation worker is ready (starting, or restarting after a "
                                                  "failure); retry shortly")
            chain = text_chain(prompt, consumer) if s.prefix_cache_mb and s.prefix_affinity else []
            worker = choose(ready, lambda w: len(w.pending), chain, self.affinity, self.overloaded)
            if len(worker.pending) >= self.capacity:
                raise RequestError("busy", f"server busy: {self.capacity * len(ready)} requests in flight, the "
                                           f"server's capacity (serving.max_batch_size + serving.max_queue per "
                                           f"worker); retry later")
            job_id = next(self.ids)
            worker.pending[job_id] = pending
            self.affinity.record(worker, chain)
        self.update_gauges()
        if chain:  # (its answer extends the prefix the worker holds: a conversation's next turn starts with both)
            pending.on_done = lambda result: self._remember(worker, prompt + result["text"], consumer)
        worker.send("generate", job_id, prompt, settings, deadline, stream, consumer)
        return Ticket(worker, job_id, pending)

    def _remember(self, worker: "WorkerHandle", text: str, consumer: str) -> None:
        with self.lock:
            self.affinity.record(worker, text_chain(text, consumer))

    def cancel(self, ticket: Ticket) -> None:
        """Give up a request (deadline, client gone): it leaves its worker's queue or running batch at once."""
        if ticket.worker.forget(ticket.job_id) is not None:
            ticket.worker.send("cancel", ticket.job_id)


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
        for worker in [*self.workers, *self.retiring]:
            worker.stop()


def _meta_of(model_dir: Path) -> dict:
    try:
        return exportdir.read_meta(model_dir)
    except ConfigError:
        return {}


def deadline_error(timeout_s: float) -> RequestError:
    return RequestError("deadline", f"deadline exceeded: no answer within {timeout_s:g}s (serving.request_timeout_s)")
