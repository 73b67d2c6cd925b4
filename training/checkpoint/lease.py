"""One writer per run: the launcher that trains a run holds it, and a second launch of the same run (a resume
started twice, or while the run still goes) is refused in one line naming the holder.

- On this machine: an exclusive `flock` on `<run dir>/writer.lock`, which the kernel releases when its holder dies
  (kill -9 included), so a requeue is never blocked. The file says who holds it.
- In the object store (`storage.uri`), for runs resumed on other machines: `runs/<run>/writer.json`, written with
  conditional writes. Taken with If-None-Match (nobody holds it) or If-Match on the ETag of a record whose holder
  stopped renewing it `storage.lease_s` ago (a crash): of two takers one wins. Renewed every lease_s / 3 with If-Match
  on its own ETag; a renewal that finds another holder's record means the lease was lost (the store was unreachable
  longer than lease_s and another launch took over): `on_lost` stops this launch. Released at the end (If-Match).
  A requeue after kill -9 of the holder waits at most lease_s (default 60 s), and not at all on the holder's own
  host, where a holder whose process is gone (pid and start time checked) is taken over at once.

Rank 0's uploader checks the holder (`holds`) before retention deletes anything in the store: a writer that lost the
lease never deletes the new writer's uploads.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

from core.errors import ConfigError
from core.processes import proc_stat
from core.storage import Store, describe, retrying

LOCK_FILE = "writer.lock"
LEASE_KEY = "writer.json"
WRITER_ENV = "PIPELINE_WRITER_ID"  # (the ranks learn their launcher's writer id: upload.py asks `holds` with it)


def writer_id(pid: int | None = None) -> str:
    """host:pid:start time (clock ticks since boot): a process, told apart from a later one with its pid."""
    pid = pid or os.getpid()
    return f"{socket.gethostname()}:{pid}:{(proc_stat(pid) or [''] * 20)[19]}"


def gone(holder: str) -> bool:
    """A holder on this host whose process no longer exists (its lease need not lapse first)."""
    host, pid, started = (holder.split(":") + ["", ""])[:3]
    return host == socket.gethostname() and pid.isdigit() and (proc_stat(int(pid)) or [""] * 20)[19] != started


def lease_key(store: Store, run_name: str) -> str:
    return store.key("runs", run_name, LEASE_KEY)


class LocalLock:
    """The flock on <run dir>/writer.lock, held for the life of this process (or until `release`)."""

    def __init__(self, run_dir: Path, holder: str):
        self.path = run_dir / LOCK_FILE
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # (not inherited by the ranks: O_CLOEXEC)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = os.pread(self.fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            raise ConfigError(f"{run_dir.name} is being trained by {who} ({self.path}); one writer per run: wait for "
                              "it to end, or stop that launcher (SIGTERM: it saves and exits)") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{_describe({'holder': holder, 'since': time.time()})}\n".encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # (closing the descriptor releases the flock)
            self.fd = None


class StoreLease:
    """runs/<run>/writer.json in the store; `acquire` or ConfigError naming the holder."""

    def __init__(self, store: Store, run_name: str, holder: str, lease_s: float, on_lost=None):
        self.store, self.run_name, self.holder, self.lease_s = store, run_name, holder, lease_s
        self.key, self.etag, self.on_lost = lease_key(store, run_name), None, on_lost
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.since = time.time()

    def record(self) -> bytes:
        return json.dumps({"holder": self.holder, "renewed_at": time.time(), "lease_s": self.lease_s,
                           "since": self.since}).encode()

    def acquire(self) -> str:
        """Take the lease (a line saying how), or raise ConfigError naming its live holder."""
        def attempt():
            etag = self.store.put_if(self.key, self.record(), IfNoneMatch="*")
            if etag:
                return etag, ""
            found = self.store.read_versioned(self.key)
            if found is None:  # (released between the two calls: try again)
                return None, ""
            data, current = found
            other = json.loads(data)
            age, who = time.time() - float(other.get("renewed_at", 0)), _describe(other)
            if gone(other["holder"]):
                how = f" (taken over from {who}: that process is gone)"
            elif age >= float(other.get("lease_s", self.lease_s)):
                how = f" (taken over from {who}: silent for {age:.0f}s)"
            else:
                raise ConfigError(f"{self.run_name} is being trained by {who} (its lease in {self.store.uri}, renewed "
                                  f"{age:.0f}s ago, lapses {other['lease_s']:g}s after its last renewal); one writer "
                                  "per run: wait for it to end, or stop that launcher")
            return self.store.put_if(self.key, self.record(), IfMatch=current), how

        for _ in range(3):
            etag, how = retrying(attempt, f"taking the writer lease of {self.run_name}", self.store)
            if etag:
                self.etag = etag
                self.thread = threading.Thread(target=self._renew, name="writer-lease", daemon=True)
                self.thread.start()
                return f"writer lease: {self.store.uri} runs/{self.run_name}/{LEASE_KEY}{how}"
        raise ConfigError(f"{self.run_name}: another launch took the writer lease in {self.store.uri} at the same "
                          "moment; one writer per run")

    def _renew(self) -> None:
        while not self.done.wait(self.lease_s / 3):
            try:
                etag = self.store.put_if(self.key, self.record(), IfMatch=self.etag)
            except Exception as exc:  # noqa: BLE001  (the store is down: renew at the next beat)
                print(f"writer lease: not renewed ({describe(exc)[1]})", flush=True)
                continue
            if etag is None:
                found = self.store.read(self.key)
                print(f"writer lease of {self.run_name} lost to {_describe(json.loads(found)) if found else 'nobody'}: "
                      "this launch stops", flush=True)
                if self.on_lost:
                    self.on_lost()
                return
            self.etag = etag

    def release(self) -> None:
        self.done.set()
        if self.etag:
            try:
                self.store.delete_if(self.key, self.etag)
            except Exception:  # noqa: BLE001  (the store is down: the lease lapses by itself after lease_s)
                pass
            self.etag = None


def holds(store: Store, run_name: str, holder: str) -> bool:
    """Is `holder` the run's writer according to the store? (True where no lease is recorded: a run without one.)"""
    data = store.read(lease_key(store, run_name))
    return data is None or json.loads(data).get("holder") == holder


def _describe(record: dict) -> str:
    host, _, rest = record["holder"].partition(":")
    since = record.get("since")
    return f"pid {rest.split(':')[0]} on {host}" + (
        f" (since {time.strftime('%H:%M:%S', time.localtime(since))})" if since else "")


class Held:
    """What a launch holds while it trains a run: the local lock and, with storage.uri, the store's lease."""

    def __init__(self, lock: LocalLock, lease: StoreLease | None):
        self.lock, self.lease = lock, lease

    def release(self) -> None:
        if self.lease:
            self.lease.release()
        self.lock.release()


def hold(run_dir: Path, storage, on_lost) -> Held:
    """Become the run's one writer (this process, for the ranks it starts: $PIPELINE_WRITER_ID), or raise
    ConfigError naming the holder. `on_lost`: called if the store's lease is lost while training."""
    holder = writer_id()
    lock = LocalLock(run_dir, holder)
    store_lease = None
    if storage.uri:  # (the config's storage section)
        store_lease = StoreLease(Store.of(storage), run_dir.name, holder, storage.lease_s, on_lost)
        try:
            print(store_lease.acquire(), flush=True)
        except BaseException:
            lock.release()
            raise
    os.environ[WRITER_ENV] = holder
    return Held(lock, store_lease)
