"""The server process: Paddle Serving's Pipeline (HTTP + gRPC), the OpenAI-compatible and health routes
(serving/api.py) and the metrics port (serving/metrics.py), all in front of the generation worker processes
(serving/worker.py, managed by serving/dispatch.py).

Request  (HTTP `POST /<service>/prediction`, or gRPC PipelineClient): key/value lists of strings,
    prompt (required), max_new_tokens, temperature (0 = greedy, the default), top_k (0 = off), seed, timeout_s (the
    request's deadline, at most serving.request_timeout_s, the default)
Response: err_no 0 and key/value lists: text, token_ids (JSON list), model_name, model_version, source_run_id,
    checkpoint_step, batch_size (the largest batch the request was decoded in), ttft_ms and tpot_ms (time to its
    first token since it reached the server, and per token after it). Errors: err_no 8001 bad request,
    8002 internal, 8003 busy, 8004 deadline exceeded, 8005 the worker died (retry), 8006 unavailable (starting or
    shutting down), with a message; the server stays up.

The Op runs as threads (one per request in flight) that hand requests to the worker and wait: the worker batches
them between decode steps (serving/engine.py), which Paddle Serving's own batching cannot (it hands an Op a whole
batch). SIGTERM drains: readiness goes false, new requests are refused, those in flight finish within
`serving.drain_grace_s`, then the process exits 0.

Run by `make serve` as `python -m serving.service --config <rendered config.yml> --service-config <yaml> --model
<export dir> --state-dir <dir>`.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import serving  # noqa: F401  (zlib first; paddle_serving_client stand-in)
from serving.generation import GenerationSettings
from serving.dispatch import CODES, Dispatcher, ServingError
from serving.model import RequestError, lineage

# Application error codes, returned as err_no (Paddle Serving's own codes are below 1000 or negative).
BAD_REQUEST = CODES["bad_request"]
INTERNAL_ERROR = CODES["internal"]
FIELDS = ("prompt", "max_new_tokens", "temperature", "top_k", "seed", "timeout_s")


@dataclass(frozen=True)
class Limits:
    max_prompt_chars: int
    max_new_tokens_limit: int
    default_max_new_tokens: int
    max_request_bytes: int
    request_timeout_s: float = 30.0  # the deadline of a request that names none, and the longest one may name

    @classmethod
    def from_config(cls, serving_config) -> "Limits":
        return cls(serving_config.max_prompt_chars, serving_config.max_new_tokens_limit,
                   serving_config.default_max_new_tokens, serving_config.max_request_bytes,
                   serving_config.request_timeout_s)


def _number(name: str, raw, kind, low, high):
    if not isinstance(raw, str):
        raise RequestError(f"{name} must be sent as a string, got {type(raw).__name__}")
    try:
        value = kind(raw.strip())
    except ValueError:
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from None
    if not low <= value <= high:
        raise RequestError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def check_unique_keys(keys) -> None:
    """A key sent twice is ambiguous (which value counts?): refuse it rather than silently keep one."""
    seen, repeated = set(), []
    for key in keys:
        if key in seen and key not in repeated:
            repeated.append(key)
        seen.add(key)
    if repeated:
        raise RequestError(f"parameter(s) sent more than once: {', '.join(map(str, repeated))}")


def parse_timeout(fields: dict, limits: Limits) -> float:
    """The request's deadline in seconds: `timeout_s` if it names one (up to serving.request_timeout_s)."""
    if "timeout_s" not in fields:
        return limits.request_timeout_s
    return _number("timeout_s", fields["timeout_s"], float, 0.001, limits.request_timeout_s)


def parse_request(fields: dict, limits: Limits) -> tuple[str, GenerationSettings]:
    """Validate one request's key/value fields; every problem raises RequestError with a message for the client."""
    size = sum(len(str(k).encode()) + len(str(v).encode()) for k, v in fields.items())
    if size > limits.max_request_bytes:
        raise RequestError(f"request is {size} bytes; the limit is {limits.max_request_bytes}")
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise RequestError(f"unknown parameter(s) {', '.join(unknown)}; allowed: {', '.join(FIELDS)}")
    if "prompt" not in fields:
        raise RequestError("missing prompt: send key 'prompt' with the text to continue")
    prompt = fields["prompt"]
    if not isinstance(prompt, str):
        raise RequestError(f"prompt must be a string, got {type(prompt).__name__}")
    prompt = prompt.strip()
    if not prompt:
        raise RequestError("prompt is empty")
    if len(prompt) > limits.max_prompt_chars:
        raise RequestError(f"prompt has {len(prompt)} characters; the limit is {limits.max_prompt_chars}")
    settings = GenerationSettings(
        max_new_tokens=_number("max_new_tokens", fields.get("max_new_tokens", str(limits.default_max_new_tokens)), int,
                               1, limits.max_new_tokens_limit),
        temperature=_number("temperature", fields.get("temperature", "0"), float, 0.0, 10.0),
        top_k=_number("top_k", fields.get("top_k", "0"), int, 0, 1_000_000),
        seed=_number("seed", fields.get("seed", "0"), int, 0, 2**31 - 1),
    )
    return prompt, settings


def _make_op_classes(dispatcher: Dispatcher, limits: Limits, metrics):
    """The Paddle Serving classes of the service, built here because paddle_serving_server is imported only in the
    server process (serving/__init__.py applies its workarounds first)."""
    from paddle_serving_server.pipeline import RequestOp
    from paddle_serving_server.web_service import Op, WebService

    class UniqueKeysRequestOp(RequestOp):
        """Paddle Serving turns the request's key/value lists into a dict, so a repeated key would silently keep its
        last value; this is the documented extension point (`unpack_request_package`) to refuse it first."""

        def unpack_request_package(self, request):
            try:
                check_unique_keys(request.key)
            except RequestError as exc:
                return {}, request.logid, BAD_REQUEST, str(exc)
            return super().unpack_request_package(request)

    generate_op = type("GenerateOp", (GenerateMethods, Op), {"dispatcher": dispatcher, "limits": limits,
                                                              "metrics": metrics})

    class GenerateService(WebService):
        def get_pipeline_response(self, read_op):
            # The DAG is found from the response op back through input_ops: our request op replaces `read_op`.
            return generate_op(name=self.name, input_ops=[UniqueKeysRequestOp()])

    return GenerateService


class GenerateMethods:
    """preprocess: validate the request; process: hand it to the generation worker and wait for its answer (or its
    error: busy, deadline, worker died); postprocess: the answer's fields and the model's lineage. Mixed in before
    Paddle Serving's Op by `_make_op_classes`, with the dispatcher, limits and metrics as class attributes.

    Paddle Serving calls `process()` only for Ops it built a client for from `local_service_conf.model_config`;
    the two overrides below declare the Op as serving without one (the worker process holds the model)."""

    dispatcher = limits = metrics = None

    def init_from_dict(self, conf):
        super().init_from_dict(conf)
        self.with_serving = True

    def init_client(self, client_config, server_endpoints):
        return None

    def preprocess(self, input_dicts, data_id, log_id):
        ((_, fields),) = input_dicts.items()
        try:
            request = (*parse_request(dict(fields), self.limits), parse_timeout(dict(fields), self.limits))
        except RequestError as exc:
            self.metrics.refused("paddle_serving", "bad_request")
            return None, False, BAD_REQUEST, str(exc)
        return {"request": (time.monotonic(), *request)}, False, None, ""

    def process(self, feed_batch, typical_logid=0):
        arrived, prompt, settings, timeout_s = feed_batch[0]["request"]
        try:
            result = self.dispatcher.generate(prompt, settings, timeout_s)
        except ServingError as exc:
            self.metrics.refused("paddle_serving", exc.kind)
            return None, exc.code, exc.message
        except Exception as exc:  # noqa: BLE001  (reported to the client; the server keeps serving)
            self.metrics.refused("paddle_serving", "internal")
            return None, INTERNAL_ERROR, f"generation failed: {exc.__class__.__name__}: {exc}"
        self.metrics.answered("paddle_serving", arrived, result)
        # (a list: Paddle Serving slices each output by the request's rows)
        return {"result": [{**result, "arrived": arrived}]}, 0, ""

    def postprocess(self, input_dicts, fetch_dict, data_id, log_id):
        result = fetch_dict["result"][0]
        return {"text": result["text"], "token_ids": json.dumps(result["token_ids"]),
                "batch_size": str(result["batch_size"]), **timings(result), **lineage(self.dispatcher.meta)}, None, ""


def timings(result: dict) -> dict[str, str]:
    """Server-side times of an answer: to its first token (from the request's arrival at the server) and per token
    after it, in ms."""
    tokens, first = len(result["token_ids"]), result.get("first_token_at")
    ttft = (first - result["arrived"]) * 1000 if first else 0.0
    tpot = (result["finished_at"] - first) * 1000 / (tokens - 1) if first and tokens > 1 else 0.0
    return {"ttft_ms": f"{ttft:.2f}", "tpot_ms": f"{tpot:.3f}"}


def workers(serving_config) -> int:
    """Generation worker processes: serving.workers, or (0) one per core this server may use (one per GPU on
    serving.device=gpu: serving/placement.py)."""
    from serving.placement import worker_count

    return worker_count(serving_config)


def capacity(serving_config) -> int:
    """Requests in flight at most: each worker's running batch and queue."""
    return workers(serving_config) * (serving_config.max_batch_size + serving_config.max_queue)


def predictor_threads(serving_config) -> int:
    """Math threads of each worker's predictors: serving.predictor_threads, or (0) an even share of the cores (1 on
    GPU: the host only feeds the device)."""
    from core.workarounds import cpu_runtime

    if serving_config.device == "gpu":
        return 1
    return cpu_runtime.threads_per_process(serving_config.predictor_threads, workers(serving_config))


def render_config(config) -> dict:
    """Paddle Serving's config.yml, from the typed config: thread Ops, one per request in flight (plus a few, so that
    one more request reaches the busy check instead of queueing inside Paddle Serving), no auto-batching."""
    s = config.serving
    threads = capacity(s) + 4
    return {
        "worker_num": s.rpc_workers or threads,  # gRPC threads: fewer would queue requests unseen
        "build_dag_each_worker": False,
        "rpc_port": s.rpc_port,
        "http_port": s.http_port,
        "dag": {"is_thread_op": True, "retry": 1, "use_profile": False, "tracer": {"interval_s": -1}},
        "op": {
            s.service_name: {
                "concurrency": threads,
                "timeout": -1,
                "retry": 1,
                "batch_size": 1,  # (the worker batches; Paddle Serving's auto-batching would only add a wait)
                "auto_batching_timeout": -1,
                "local_service_conf": {},  # no model or client type: the worker process holds the model
            }
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="rendered Paddle Serving config.yml")
    parser.add_argument("--service-config", required=True, help="the pipeline's resolved YAML config")
    parser.add_argument("--model", required=True, help="export directory")
    parser.add_argument("--state-dir", required=True, help="where worker.json is kept")
    args = parser.parse_args()
    from core import exportdir
    from core.config import load_config
    from core.workarounds.paddle_serving import server_fixes
    from serving.api import ApiServer
    from serving.metrics import ServingMetrics

    config = load_config(args.service_config)
    s = config.serving
    model_dir = Path(args.model)
    metrics = ServingMetrics()
    metrics.serve(s.metrics_port, s.host)
    dispatcher = Dispatcher(s, model_dir, predictor_threads(s), workers(s), metrics, Path(args.state_dir),
                            on_fatal=_exit_fatal)
    dispatcher.meta = exportdir.read_meta(model_dir)
    dispatcher.start()
    limits = Limits.from_config(s)
    ApiServer(dispatcher, limits, dispatcher.meta, metrics).start(s.host, s.api_port)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=_drain, args=(dispatcher, s.drain_grace_s),
                                                              daemon=True).start())
    server_fixes()  # (Paddle Serving: one Op thread woken per request, not all of them; no per-request log records)
    service = _make_op_classes(dispatcher, limits, metrics)(name=s.service_name)
    service.prepare_pipeline_config(args.config)
    service.run_service()


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
    from core.processes import descendants, signal_pids

    signal_pids(descendants(os.getpid()), signal.SIGKILL)


if __name__ == "__main__":
    main()
