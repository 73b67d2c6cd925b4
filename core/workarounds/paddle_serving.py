"""Paddle Serving 0.9.0 on Python 3.11 (applied by `serving/__init__.py`, for everything under serving/).

- paddle_serving_server 0.9.0 imports `paddle_serving_client` at load time, which has no Python 3.11 build: the
  stand-in in core/workarounds/serving_compat/ is put on sys.path when the real package is absent;
- importing paddle_serving_server.pipeline (the gRPC client too) creates PipelineServingLogs/ in the current
  directory unless SERVING_LOG_PATH says where: clients log under the temp directory, the server (serving/controller.py)
  into its state directory;
- per request, the server process paid for two things it does not need (found with py-spy on a one-client loop of
  1-token requests; the figures: docs/platform-notes.md):
  * its thread-mode channels (`ThreadChannel.push`) wake *every* thread waiting on the channel (`notify_all`) for
    each item: an Op with `concurrency` N has N threads waiting on its input channel, so each request woke all of them
    (36 by default here) to queue for the GIL and find the queue empty again (66% of the process's samples).
    `quiet_channel_wakeups()` wakes one thread per item where that is exact: one producer, one consumer Op (all its
    threads take any item), an unbounded queue (no producer ever waits on the condition), not
    `channel_recv_frist_arrive`; every other case, and `stop()`, keep Paddle Serving's code;
  * Paddle Serving's `paddle_serving_server/pipeline/logger.py` sets the root logger to DEBUG, so each request
    built ~30 debug records that no handler keeps, and wrote 5 INFO lines to PipelineServingLogs/pipeline.log (~170
    bytes a request: up to 20 x 512 MB of rotated files on a busy server). `quiet_pipeline_log()` sets Paddle
    Serving's own loggers to WARNING: its warnings and errors still reach pipeline.log and pipeline.log.wf; requests
    are counted by serving/server/metrics.py.
  `PIPELINE_SERVING_FIXES=off` leaves both as shipped (benchmarks: before/after in one run).
- its gRPC server binds `[::]:<rpc_port>`, every interface, hard-coded (pipeline_server.py): `grpc_bind(host)` makes
  that `<serving.host>:<rpc_port>` (loopback by default, behind the gateway). Its Go HTTP gateway
  (libproxy_server.so, run in a child process) listens on `":" + strconv.Itoa(http_port)`, every interface, compiled
  in: no option, no environment variable, and Go makes its own system calls (an LD_PRELOAD of bind() never sees
  them). `http_bind(host)` loads, for a loopback `serving.host`, a copy of the library whose two operands of that
  concatenation point at "127.0.0.1:" instead of ":" (the first 10 bytes of the library's own "127.0.0.1:53", its DNS
  default): the copy is made only from the shipped 0.9.0 x86_64 build (sha256 and every byte replaced are checked
  first); any other build runs as shipped, with a warning in server.log. Any other host: every interface, as
  shipped (docs/gateway.md).
"""
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from ctypes import cdll
import hashlib
import logging

COMPAT_DIR = Path(__file__).resolve().parent / "serving_compat"
FIXES_ENV = "PIPELINE_SERVING_FIXES"


def apply() -> None:
    if importlib.util.find_spec("paddle_serving_client") is None and str(COMPAT_DIR) not in sys.path:
        sys.path.append(str(COMPAT_DIR))
    os.environ.setdefault("SERVING_LOG_PATH", os.path.join(tempfile.gettempdir(), "paddle-serving-client"))


def server_fixes() -> bool:
    """The server process's fixes (see the module's docstring); True if applied."""
    if os.environ.get(FIXES_ENV, "on") == "off":
        return False
    quiet_channel_wakeups()
    quiet_pipeline_log()
    return True


def grpc_bind(host: str) -> None:
    """Paddle Serving's gRPC port on `host` instead of every interface (see the module's docstring)."""
    from grpc import _server

    shipped = _server._Server.add_insecure_port
    if getattr(shipped, "bound_to", None) == host:
        return

    def add_insecure_port(self, address):
        if address.startswith("[::]:"):
            address = f"{'[' + host + ']' if ':' in host else host}:{address.rsplit(':', 1)[1]}"
        return shipped(self, address)

    add_insecure_port.bound_to = host
    _server._Server.add_insecure_port = add_insecure_port


# libproxy_server.so of paddle-serving-server 0.9.0 (x86_64) and, in its main.run_proxy_server, the operands of
# runtime.concatstring2(":", strconv.Itoa(http_port)): `mov $1,%ecx` (the length) at 0x6bab19 and
# `lea 0xdfe(%rip),%rbx` (":" at 0x6bb92b) at 0x6bab26; "127.0.0.1:53" lies at 0x6c1aec (file offset = address here).
PROXY_SHA256 = "668e36533356a521f1b106700cb204a4d52a7235dc419546183057f0789cc0bb"
PROXY_LOOPBACK_PATCH = ((0x6bab1a, (1).to_bytes(4, "little"), (10).to_bytes(4, "little")),
                        (0x6bab29, (0xdfe).to_bytes(4, "little"), (0x6c1aec - 0x6bab2d).to_bytes(4, "little")))
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


def loopback_proxy_library(shipped: Path, cache_dir: Path) -> Path | None:
    """A copy of Paddle Serving's Go HTTP gateway that listens on 127.0.0.1 (see the module's docstring), made once
    in `cache_dir` and published by rename; None when `shipped` is not the build the patch is for."""
    data = bytearray(shipped.read_bytes())
    if hashlib.sha256(data).hexdigest() != PROXY_SHA256:
        return None
    target = cache_dir / f"libproxy_server-{PROXY_SHA256[:12]}-loopback.so"
    if target.exists():
        return target
    for offset, old, new in PROXY_LOOPBACK_PATCH:
        if data[offset:offset + len(old)] != old:
            return None
        data[offset:offset + len(new)] = new
    if data[0x6c1aec:0x6c1aec + 10] != b"127.0.0.1:":
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f"{target.name}.{os.getpid()}.part")
    part.write_bytes(bytes(data))
    os.replace(part, target)
    return target


def http_bind(host: str) -> bool:
    """Paddle Serving's Go HTTP gateway on 127.0.0.1 when `host` is a loopback address (see the module's docstring);
    True if so. Else it listens on every interface, as shipped (warned about when `host` asked for loopback)."""
    if host not in LOOPBACK_HOSTS:
        return False
    from paddle_serving_server.pipeline import gateway
    from paddle_serving_server.pipeline.pipeline_server import PipelineServer

    shipped = Path(gateway.__file__).parent / "libproxy_server.so"
    library = loopback_proxy_library(shipped, Path(tempfile.gettempdir()) / "paddle-serving-proxy")
    if library is None:
        print(f"warning: {shipped} is not the build whose listen address this project can set: Paddle Serving's "
              "HTTP port listens on every interface", file=sys.stderr, flush=True)
        return False

    def _grpc_gateway(self, grpc_port, http_port):  # (PipelineServer's own, on the copy: it runs in a child process)
        cdll.LoadLibrary(str(library)).run_proxy_server(grpc_port, http_port)

    PipelineServer._grpc_gateway = _grpc_gateway
    return True


def quiet_pipeline_log() -> None:
    import paddle_serving_server.pipeline.logger  # noqa: F401  (its dictConfig first, then the level over it)

    logging.getLogger("paddle_serving_server").setLevel(logging.WARNING)


def quiet_channel_wakeups() -> None:
    """Patch paddle_serving_server's ThreadChannel.push (see the module's docstring)."""
    from paddle_serving_server.pipeline import channel

    shipped = channel.ThreadChannel.push
    if getattr(shipped, "wakes_one", False):
        return

    def push(self, channeldata, op_name=None):
        if (len(self._producers) != 1 or len(self._consumer_cursors) != 1 or self._channel_recv_frist_arrive
                or self._maxsize > 0):
            return shipped(self, channeldata, op_name)
        with self._cv:
            if self._stop:
                raise channel.ChannelStopError()
            self.put((channeldata.id, {op_name: channeldata}), timeout=0)  # (unbounded: never full)
            self._cv.notify()
        return True

    push.wakes_one = True
    channel.ThreadChannel.push = push
