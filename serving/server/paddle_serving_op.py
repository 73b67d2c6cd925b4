"""Paddle Serving's Python Pipeline service of the server process (serving/server/main.py): the request Op over
the dispatcher, for HTTP `POST /<service>/prediction` and gRPC PipelineClient.

Request  (HTTP `POST /<service>/prediction`, or gRPC PipelineClient): key/value lists of strings, the fields of
    serving/protocol.py: prompt (required), max_new_tokens, temperature (0 = greedy, the default), top_k, top_p,
    seed, stop (a string or a JSON list), n, logprobs, echo, timeout_s
Response: err_no 0 and key/value lists: text, token_ids (JSON list), finish_reason, model_name, model_version,
    source_run_id, checkpoint_step, batch_size (the largest batch the request was decoded in), ttft_ms and tpot_ms
    (time to its first token since it reached the server, and per token after it); `choices` (n > 1) and `logprobs`
    as JSON. Errors: err_no 8001 bad request, 8002 internal, 8003 busy, 8004 deadline exceeded, 8005 the worker
    died (retry), 8006 unavailable (starting or shutting down), with a message; the server stays up.

The Op runs as threads (one per request in flight) that hand requests to the worker and wait: the worker batches
them between decode steps (serving/engine/scheduler.py), which Paddle Serving's own batching cannot (it hands an Op
a whole batch).
"""
from __future__ import annotations

import json
import time

import serving  # noqa: F401  (zlib first; paddle_serving_client stand-in)
from serving.protocol import KINDS, Limits, Request, RequestError, bad, check_unique_keys, from_strings, parse

BAD_REQUEST, INTERNAL_ERROR = KINDS["bad_request"][0], KINDS["internal"][0]


def parse_fields(fields: dict, limits: Limits) -> Request:
    """One request's key/value strings -> a checked Request (serving/protocol.py); RequestError otherwise."""
    size = sum(len(str(k).encode()) + len(str(v).encode()) for k, v in fields.items())
    if size > limits.max_request_bytes:
        raise bad(f"request is {size} bytes; the limit is {limits.max_request_bytes}")
    return parse(from_strings(fields), limits)


def make_service(dispatcher, limits: Limits, metrics):
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
    Paddle Serving's Op by `make_service`, with the dispatcher, limits and metrics as class attributes.

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
            request = parse_fields(dict(fields), self.limits)
        except RequestError as exc:
            self.metrics.refused("paddle_serving", "bad_request")
            return None, False, exc.code, exc.message
        return {"request": (time.monotonic(), request)}, False, None, ""

    def process(self, feed_batch, typical_logid=0):
        # Errors travel to postprocess as data: Paddle Serving appends a pointer to its own log to process()'s error
        # messages ("Please check the input dict and checkout PipelineServingLogs/pipeline.log"), not to these.
        arrived, request = feed_batch[0]["request"]
        try:
            results = self.dispatcher.generate_choices(request)
        except RequestError as exc:
            self.metrics.refused("paddle_serving", exc.kind)
            return {"result": [{"error": (exc.code, exc.message)}]}, 0, ""
        except Exception as exc:  # noqa: BLE001  (reported to the client; the server keeps serving)
            self.metrics.refused("paddle_serving", "internal")
            return {"result": [{"error": (INTERNAL_ERROR, f"generation failed: {exc.__class__.__name__}: {exc}")}]}, \
                0, ""
        for result in results:
            self.metrics.answered("paddle_serving", arrived, result)
        # (a list: Paddle Serving slices each output by the request's rows)
        return {"result": [{"choices": results, "arrived": arrived, "request": request}]}, 0, ""

    def postprocess(self, input_dicts, fetch_dict, data_id, log_id):
        answer = fetch_dict["result"][0]
        if "error" in answer:
            return {}, *answer["error"]
        return answer_fields(answer["request"], answer["choices"], answer["arrived"]), None, ""


def answer_fields(request: Request, choices: list[dict], arrived: float) -> dict[str, str]:
    """Paddle Serving's answer: the first choice's text and token ids (echo: the prompt before the text), its
    finish reason and timings, the lineage of the model that generated it; `choices` (n > 1) and `logprobs` as JSON
    when asked for."""
    first = {**choices[0], "arrived": arrived}
    prefix = request.prompt if request.echo else ""
    out = {"text": prefix + first["text"], "token_ids": json.dumps(first["token_ids"]),
           "finish_reason": first["finish_reason"], "batch_size": str(first["batch_size"]), **timings(first),
           **first["lineage"]}
    if request.n > 1:
        out["choices"] = json.dumps([{"text": prefix + c["text"], "token_ids": c["token_ids"],
                                      "finish_reason": c["finish_reason"]} for c in choices], ensure_ascii=False)
    if request.settings.logprobs >= 0:
        out["logprobs"] = json.dumps([c["logprobs"] for c in choices] if request.n > 1 else first["logprobs"],
                                     ensure_ascii=False)
    return out


def timings(result: dict) -> dict[str, str]:
    """Server-side times of an answer: to its first token (from the request's arrival at the server) and per token
    after it, in ms."""
    tokens, first = len(result["token_ids"]), result.get("first_token_at")
    ttft = (first - result["arrived"]) * 1000 if first else 0.0
    tpot = (result["finished_at"] - first) * 1000 / (tokens - 1) if first and tokens > 1 else 0.0
    return {"ttft_ms": f"{ttft:.2f}", "tpot_ms": f"{tpot:.3f}"}
