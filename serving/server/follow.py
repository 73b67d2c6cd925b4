"""A running server follows its model reference: `make serve MODEL=models:/<name>@<alias>` (or `/latest`) serves
whatever version the reference names now. Every `serving.follow_interval_s` (0: only when asked), on SIGHUP
(`make reload`) or on `POST /admin/reload`, the reference is resolved again (core/registry.py: the registry, the
version's export directory, downloaded when needed); when it names another export directory, the dispatcher
switches to it (serving/engine/dispatch.py `switch`: new workers load beside the old ones, requests in flight finish
on the old version, no request fails). A registry that cannot be reached, or a version that cannot load, is logged
and the current version keeps serving.
"""
from __future__ import annotations

import threading
from pathlib import Path


class Follower:
    def __init__(self, dispatcher, resolve, interval_s: float, log):
        """resolve() -> the export directory the reference names now (raises on any failure)."""
        self.dispatcher, self.resolve, self.interval_s, self.log = dispatcher, resolve, interval_s, log
        self.wake = threading.Event()
        self.lock = threading.Lock()  # (one check at a time: the timer, a signal and the admin route)

    def start(self) -> None:
        threading.Thread(target=self._loop, name="follow", daemon=True).start()

    def _loop(self) -> None:
        while not self.dispatcher.stopping:
            self.wake.wait(self.interval_s if self.interval_s > 0 else None)
            self.wake.clear()
            if not self.dispatcher.stopping:
                self.check()

    def trigger(self) -> None:
        """Check now, in the background (signal handlers must not block)."""
        self.wake.set()

    def check(self) -> dict:
        """Resolve the reference; switch when it moved. Returns what happened (the admin route's answer)."""
        with self.lock:
            current = Path(self.dispatcher.model_dir)
            try:
                target = Path(self.resolve())
            except Exception as exc:  # noqa: BLE001  (registry down, download failed: keep serving)
                message = f"{exc.__class__.__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                self.log(f"follow: could not resolve the model reference ({message}); still serving {current}")
                return {"switched": False, "error": message, **self._serving()}
            if target.resolve() == current.resolve():
                return {"switched": False, **self._serving()}
            self.log(f"follow: the model reference now names {target}; loading it")
            switched = self.dispatcher.switch(target)
            return {"switched": switched, **({} if switched else {"error": f"could not load {target}"}),
                    **self._serving()}

    def _serving(self) -> dict:
        meta = self.dispatcher.meta
        return {"model": meta.get("registered_model_name"), "version": str(meta.get("version")),
                "model_dir": str(self.dispatcher.model_dir)}
