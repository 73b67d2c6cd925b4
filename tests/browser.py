"""A real browser for the tests: Debian's headless Chromium driven over the DevTools protocol (what Selenium's
driver does, without the driver), with `websockets` from the lock.

    with Browser(out_dir) as browser:
        page = browser.open("http://127.0.0.1:18040/app/scalar")
        page.wait_for("document.querySelectorAll('canvas').length >= 2")
        page.screenshot("visualdl.png")
        page.console_errors, page.requests   # what the page logged as errors, the URLs it fetched
"""
from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def chromium() -> str:
    for name in CHROMIUM:
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError("no Chromium on PATH: `apt-get install chromium` (.ci/run installs it)")


class Page:
    def __init__(self, socket):
        self.socket, self.ids = socket, itertools.count(1)
        self.console_errors: list[str] = []
        self.requests: list[str] = []

    def call(self, method: str, timeout_s: float = 30, **params) -> dict:
        ident = next(self.ids)
        self.socket.send(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            message = json.loads(self.socket.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._event(message)

    def _event(self, message: dict) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.console_errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.console_errors.append(details.get("exception", {}).get("description") or details.get("text", ""))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            self.console_errors.append(params["entry"].get("text", ""))
        elif method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.evaluate(f"Boolean({expression})"):
            if time.monotonic() > deadline:
                raise AssertionError(f"the page never met {expression!r}; console errors: {self.console_errors}")
            self.drain(0.25)

    def drain(self, seconds: float) -> None:
        """Read the events that arrive for `seconds` (console messages, requests)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                self._event(json.loads(self.socket.recv(timeout=max(0.01, deadline - time.monotonic()))))
            except TimeoutError:
                return

    def screenshot(self, path: Path) -> Path:
        Path(path).write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return Path(path)


class Browser:
    def __init__(self, width: int = 1400, height: int = 1000):
        self.size = (width, height)

    def __enter__(self) -> "Browser":
        from core.processes import free_port

        self.profile = tempfile.mkdtemp(prefix="chromium-")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", f"--user-data-dir={self.profile}", f"--remote-debugging-port={self.port}",
             f"--window-size={self.size[0]},{self.size[1]}", "--lang=en-US", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.sockets = []
        return self

    def open(self, url: str) -> Page:
        import requests
        from websockets.sync.client import connect

        deadline = time.monotonic() + 30
        while True:
            try:
                target = requests.put(f"http://127.0.0.1:{self.port}/json/new?about:blank", timeout=2).json()
                break
            except (requests.RequestException, ValueError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("Chromium's DevTools endpoint did not answer") from None
                time.sleep(0.2)
        socket = connect(target["webSocketDebuggerUrl"], max_size=None)
        self.sockets.append(socket)
        page = Page(socket)
        for domain in ("Page", "Runtime", "Log", "Network"):
            page.call(f"{domain}.enable")
        page.call("Page.navigate", url=url)
        page.wait_for("document.readyState === 'complete'")
        return page

    def __exit__(self, *exc) -> None:
        for socket in self.sockets:
            socket.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)
