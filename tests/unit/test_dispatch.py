"""serving/engine/dispatch.py with fake workers (threads speaking the worker's message protocol over a real socket
pair): routing, capacity, deadlines, a dead worker's requests and restart window, draining, and switching models."""
import os
import socket
import threading
import time
from multiprocessing.connection import Connection
from types import SimpleNamespace

import pytest
from helpers import wait_until

from serving.engine import dispatch
from serving.engine.dispatch import Dispatcher, WorkerHandle, per_worker_capacity
from serving.protocol import GenerationSettings, Request
from serving.protocol import RequestError

META = {"registered_model_name": "m", "version": 1, "source_run_id": "r1", "checkpoint_step": 7}


def settings(**overrides):
    values = dict(max_batch_size=2, max_queue=1, request_timeout_s=5.0, restart_window_s=60.0, max_worker_restarts=1,
                  generation="kv_cache", max_batch_tokens=0, scheduler="continuous", device="cpu", prefix_cache_mb=0, prefix_affinity=True)
    return SimpleNamespace(**{**values, **overrides})


class FakeProc:
    def __init__(self):
        self.code, self.ended = None, threading.Event()

    def poll(self):
        return self.code

    def wait(self, timeout=None):
        self.ended.wait(timeout)
        return self.code

    def kill(self):
        self.end(-9)

    def end(self, code):
        self.code = code
        self.ended.set()


class FakeWorkers:
    """Each spawned worker answers ("done") when the test releases it, or at once with auto=True; records what it
    was sent; `kill(i)` ends worker i like a crash (its socket closes). `fail_model` never becomes ready."""

    def __init__(self, monkeypatch, auto=True):
        self.auto, self.spawned, self.received, self.fail_model = auto, [], [], None
        self.release = threading.Event()
        fakes = self

        def spawn(handle):
            ours, theirs = socket.socketpair()
            handle.conn, handle.proc = Connection(ours.detach()), FakeProc()
            record = SimpleNamespace(handle=handle, proc=handle.proc, sock=theirs,
                                     conn=Connection(os.dup(theirs.fileno())))
            fakes.spawned.append(record)
            threading.Thread(target=fakes.serve, args=(record,), daemon=True).start()

        monkeypatch.setattr(WorkerHandle, "_spawn", spawn)

    def serve(self, record):
        conn, handle = record.conn, record.handle
        if str(handle.model_dir) == str(self.fail_model):
            record.proc.end(1)
            record.sock.shutdown(socket.SHUT_RDWR)  # (a process that exits while loading)
            return
        conn.send(("ready", {"pid": len(self.spawned), "load_s": 0.0, "rss_mb": 1.0}))
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            self.received.append((record, message))
            if message[0] == "stop":
                record.proc.end(0)
                record.sock.shutdown(socket.SHUT_RDWR)
                return
            if message[0] == "generate":
                threading.Thread(target=self.answer, args=(record, message[1], message[2]), daemon=True).start()

    def answer(self, record, job_id, prompt):
        if not self.auto:
            self.release.wait(10)
        try:
            record.conn.send(("done", job_id, {"text": prompt.upper(), "token_ids": [1], "finish_reason": "length"}))
        except OSError:
            pass

    def kill(self, i):
        record = self.spawned[i]
        record.proc.end(-9)
        record.sock.shutdown(socket.SHUT_RDWR)  # (wakes both ends at once, as a crashed process's closed socket)


def started(s, workers=2, model_dir="/models/v1", **kwargs):
    d = Dispatcher(s, model_dir, threads=1, workers=workers, log=lambda text: None, **kwargs)
    d.meta = dict(META)
    for w in d.workers:
        w.lineage = {"model_name": "m", "model_version": "1"}
    d.start()
    assert wait_until(lambda: all(w.ready.is_set() for w in d.workers))
    return d


def test_capacity_per_worker():
    assert per_worker_capacity(settings(max_batch_size=8, max_queue=4), 3) == 12
    # -1: the queue that makes the whole server admit 128 in flight (ceil(128 / 3) = 43 per worker)
    assert per_worker_capacity(settings(max_batch_size=8, max_queue=-1), 3) == 43
    assert per_worker_capacity(settings(max_batch_size=200, max_queue=-1), 1) == 200


def test_requests_go_to_the_least_busy_worker_and_answer_with_its_lineage(monkeypatch):
    fakes = FakeWorkers(monkeypatch, auto=False)
    d = started(settings())
    tickets = [d.submit(f"p{i}", GenerationSettings()) for i in range(4)]
    assert [t.worker.index for t in tickets] == [0, 1, 0, 1]
    fakes.release.set()
    assert all(t.pending.done.wait(5) for t in tickets)
    assert [t.pending.result["text"] for t in tickets] == ["P0", "P1", "P2", "P3"]
    assert tickets[0].pending.result["lineage"] == {"model_name": "m", "model_version": "1"}
    d.stop()


def test_with_prefix_caching_a_prompt_goes_to_the_worker_holding_its_prefix_unless_it_is_overloaded(monkeypatch):
    """serving/engine/affinity.py: a conversation's next turn (its prompt + answer + more) goes to the worker that
    answered it; a prefix no worker holds, or a consumer's own, goes by load; the worker is passed over once it has
    `overloaded` (max(2, max_batch_size // 4)) more requests than the least busy."""
    fakes = FakeWorkers(monkeypatch, auto=False)
    d = started(settings(prefix_cache_mb=64, max_batch_size=8, max_queue=8))
    history = "系统：你是一个有用的助手。" * 3  # (36 characters: two whole blocks)
    first = d.submit(history + "用户：你好", GenerationSettings(), consumer="a")
    other = d.submit("另一个完全不同的对话开头，没有共同的前缀。", GenerationSettings())  # (by load)
    assert other.worker is not first.worker
    fakes.release.set()
    assert first.pending.done.wait(5) and other.pending.done.wait(5)
    fakes.release.clear()
    turn = history + "用户：你好" + first.pending.result["text"] + "用户：再见"
    assert d.submit(turn, GenerationSettings(), consumer="a").worker is first.worker  # (busier by 1 now)
    assert d.submit(turn, GenerationSettings(), consumer="b").worker is not first.worker  # (b's blocks are b's)
    held = [d.submit(turn, GenerationSettings(), consumer="a") for _ in range(2)]
    assert {t.worker for t in held} == {first.worker}  # (as busy as the other, then 1 more: still chosen)
    assert d.submit(turn, GenerationSettings(), consumer="a").worker is not first.worker  # (overloaded)
    sent = {m[1]: m for _, m in fakes.received if m[0] == "generate"}  # (by job id)
    assert sent[first.job_id][2] == history + "用户：你好" and sent[first.job_id][-1] == "a"
    assert sent[other.job_id][-1] == ""
    fakes.release.set()
    d.stop()


def test_a_full_server_refuses_at_once_and_a_deadline_cancels_in_the_worker(monkeypatch):
    fakes = FakeWorkers(monkeypatch, auto=False)
    d = started(settings(max_batch_size=1, max_queue=1), workers=1)  # capacity 2
    held = [d.submit("a", GenerationSettings()), d.submit("b", GenerationSettings())]
    with pytest.raises(RequestError) as refused:
        d.submit("c", GenerationSettings())
    assert refused.value.kind == "busy" and "2 requests in flight" in refused.value.message
    d.cancel(held[1])
    with pytest.raises(RequestError) as late:
        d.generate_choices(Request("d", GenerationSettings(), timeout_s=0.2))
    assert late.value.kind == "deadline"
    assert wait_until(lambda: sum(m[0] == "cancel" for _, m in fakes.received) == 2)
    assert d.in_flight == 1  # (only "a": the cancelled and the late one are forgotten)
    fakes.release.set()
    assert held[0].pending.done.wait(5) and held[0].pending.result["text"] == "A"
    d.stop()


def test_a_dead_worker_fails_what_it_held_is_replaced_and_too_many_deaths_are_fatal(monkeypatch):
    fakes = FakeWorkers(monkeypatch, auto=False)
    fatal = []
    d = started(settings(max_worker_restarts=1), workers=1, on_fatal=fatal.append)
    ticket = d.submit("x", GenerationSettings())
    fakes.kill(0)
    assert ticket.pending.done.wait(5) and ticket.pending.error.kind == "worker_died"
    assert "killed by SIGKILL" in ticket.pending.error.message
    assert wait_until(lambda: len(fakes.spawned) == 2 and d.ready)  # replaced; serving again
    fakes.kill(1)  # the second death within the window: more than max_worker_restarts=1
    assert wait_until(lambda: bool(fatal)) and "died 2 times" in fatal[0]
    assert not d.ready and len(fakes.spawned) == 2
    with pytest.raises(RequestError) as refused:
        d.submit("y", GenerationSettings())
    assert refused.value.kind == "unavailable"


def test_drain_refuses_new_requests_and_lets_those_in_flight_finish(monkeypatch):
    fakes = FakeWorkers(monkeypatch, auto=False)
    d = started(settings(), workers=1)
    ticket = d.submit("x", GenerationSettings())
    threading.Timer(0.2, fakes.release.set).start()
    assert d.drain(grace_s=5) is True
    assert ticket.pending.result["text"] == "X"
    with pytest.raises(RequestError) as refused:
        d.submit("y", GenerationSettings())
    assert refused.value.kind == "unavailable"


def test_a_switch_finishes_old_requests_on_the_old_model_and_sends_new_ones_to_the_new(monkeypatch, tmp_path):
    fakes = FakeWorkers(monkeypatch, auto=False)
    monkeypatch.setattr(dispatch, "_meta_of", lambda path: {})
    d = started(settings(), workers=2)
    old = d.submit("old", GenerationSettings())
    v2 = {**META, "version": 2, "source_run_id": "r2"}
    monkeypatch.setattr("core.exportdir.read_meta", lambda path: v2)
    assert d.switch(tmp_path / "v2") is True
    assert (d.meta["version"], d.model_dir) == (2, tmp_path / "v2") and len(fakes.spawned) == 4
    new = d.submit("new", GenerationSettings())
    assert new.worker.model_dir == tmp_path / "v2" and old.worker.model_dir.name == "v1"
    assert d.in_flight == 2  # (the old model's request still counts)
    fakes.release.set()
    assert old.pending.done.wait(5) and new.pending.done.wait(5)
    assert old.pending.result["lineage"]["model_version"] == "1"
    assert new.pending.result["lineage"]["model_version"] == "2"
    # the old workers stop once they hold nothing, and are never restarted
    assert wait_until(lambda: all(r.proc.code == 0 for r in fakes.spawned[:2]) and not d.retiring)
    assert len(fakes.spawned) == 4
    d.stop()


def test_a_model_that_cannot_load_leaves_the_current_one_serving(monkeypatch, tmp_path):
    fakes = FakeWorkers(monkeypatch)
    d = started(settings(), workers=2)
    fakes.fail_model = tmp_path / "broken"
    monkeypatch.setattr("core.exportdir.read_meta", lambda path: {**META, "version": 9})
    assert d.switch(tmp_path / "broken", load_timeout_s=10) is False
    assert d.meta["version"] == 1 and str(d.model_dir) == "/models/v1"
    assert d.generate_choices(Request("still", GenerationSettings()))[0]["text"] == "STILL"
    # the broken model's workers are not restarted: each of its handles spawned once at most (the second may not
    # have spawned at all: the switch is abandoned as soon as the first fails to load, and a retired worker does
    # not start), and nothing spawns after the switch gave up
    broken = [spawn.handle for spawn in fakes.spawned[2:]]
    assert broken and len({id(h) for h in broken}) == len(broken) <= 2
    assert all(h.model_dir == tmp_path / "broken" and h.retired for h in broken)
    time.sleep(0.3)
    assert len(fakes.spawned) == 2 + len(broken)
    d.stop()
