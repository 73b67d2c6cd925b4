"""The server process's main: `python -m serving.server.main --config <rendered config.yml> --service-config <yaml>
--model <export dir> --state-dir <dir> [--follow models:/...]`, started by `make serve` (serving/controller.py).

It runs, in one process: the dispatcher of the generation worker processes (serving/engine/dispatch.py, which
starts serving/engine/worker.py), Paddle Serving's Pipeline service (HTTP + gRPC: serving/server/paddle_serving_op.py),
the OpenAI-compatible and health routes in a thread (serving/server/openai/), the metrics port
(serving/server/metrics.py) and, given a models:/ reference, the follower that switches versions
(serving/server/follow.py). SIGTERM drains: readiness goes false, new requests are refused, those in flight finish
within `serving.drain_grace_s`, then the process exits 0; a fatal worker failure exits 3.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

import serving  # noqa: F401  (zlib first; paddle_serving_client stand-in)
from serving.engine.dispatch import Dispatcher
from serving.protocol import Limits
from serving.server.paddle_serving_op import make_service
from serving.server.sizes import predictor_threads, workers
from core import registry
from core.config import load_config
from core.processes import descendants, signal_pids, wait_gone
from serving.server.follow import Follower
from serving.server.metrics import ServingMetrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="rendered Paddle Serving config.yml")
    parser.add_argument("--service-config", required=True, help="the pipeline's resolved YAML config")
    parser.add_argument("--model", required=True, help="export directory")
    parser.add_argument("--state-dir", required=True, help="where worker.json is kept")
    parser.add_argument("--follow", default="", help="a models:/ reference to follow (serving/server/follow.py)")
    args = parser.parse_args()
    from core.workarounds.paddle_serving import grpc_bind, http_bind, server_fixes
    from serving.server.openai.api_server import ApiServer

    config = load_config(args.service_config)
    s = config.serving
    model_dir = Path(args.model)
    metrics = ServingMetrics()
    metrics.serve(s.metrics_port, s.host)
    dispatcher = Dispatcher(s, model_dir, predictor_threads(s), workers(s), metrics, Path(args.state_dir),
                            on_fatal=_exit_fatal)
    dispatcher.start()
    follower = _follower(config, dispatcher, args.follow)
    limits = Limits.from_config(s)
    ApiServer(dispatcher, limits, metrics, model_dir, s.api_key, follower).start(s.host, s.api_port)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=_drain, args=(dispatcher, s.drain_grace_s),
                                                              daemon=True).start())
    if follower:
        signal.signal(signal.SIGHUP, lambda *_: follower.trigger())
    server_fixes()  # (Paddle Serving: one Op thread woken per request, not all of them; no per-request log records)
    grpc_bind(s.host)  # (its gRPC port on serving.host, not every interface)
    http_bind(s.host)  # (its Go HTTP gateway on loopback when serving.host is)
    service = make_service(dispatcher, limits, metrics)(name=s.service_name)
    service.prepare_pipeline_config(args.config)
    service.run_service()


def _follower(config, dispatcher: Dispatcher, reference: str):
    """A follower of `reference` (models:/...), or None when the server was given a directory."""
    if not reference:
        return None

    follower = Follower(dispatcher, lambda: registry.resolve(config, reference),
                        config.serving.follow_interval_s, lambda text: print(text, flush=True))
    follower.start()
    return follower


def _drain(dispatcher: Dispatcher, grace_s: float) -> None:
    """SIGTERM: readiness false at once, new requests refused, those in flight finish (up to grace_s); then this
    process and its children (the worker, Paddle Serving's HTTP gateway) end, with exit code 0."""
    print(f"SIGTERM: draining {dispatcher.in_flight} request(s) in flight (up to {grace_s:g}s)", flush=True)
    finished = dispatcher.drain(grace_s)
    print("drained: all requests in flight were answered" if finished else
          f"drain grace period over: {dispatcher.in_flight} request(s) cut off", flush=True)
    _end_children()
    os._exit(0)


def _exit_fatal(reason: str) -> None:
    print(f"fatal: {reason}; the server exits (exit code 3) so that its supervisor can restart it", file=sys.stderr,
          flush=True)
    _end_children()
    os._exit(3)


def _end_children() -> None:
    children = descendants(os.getpid())
    signal_pids(children, signal.SIGKILL)
    wait_gone(children, 5.0)  # (so that whoever waits for this process finds none of them left)


if __name__ == "__main__":
    main()
