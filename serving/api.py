"""The server's own HTTP routes (`serving.api_port`), next to Paddle Serving's endpoint and in front of the same
generation worker:

    GET  /health/live     200 while the server and its worker manager are up (a liveness probe)
    GET  /health/ready    200 when a worker is loaded and answered a tiny generation, 503 otherwise (readiness)
    GET  /v1/models       the served model, OpenAI's list shape
    POST /v1/completions  OpenAI's completions API (non-streaming): model, prompt, max_tokens, temperature, top_k,
                          seed; answers with choices and usage; errors in OpenAI's error shape

So the `openai` client, LangChain and chat UIs work unchanged (`base_url=http://host:<api_port>/v1`). Why not through
Paddle Serving: its gateway is unary key/value JSON (no OpenAI shapes, no streaming); this route is a thin adapter.
`stream: true` is refused: tokens would have to be streamed out of the worker, which batches whole answers.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from serving.dispatch import ServingError
from serving.generation import GenerationSettings

LIVE, READY, MODELS, COMPLETIONS = "/health/live", "/health/ready", "/v1/models", "/v1/completions"
ROUTES = {"GET": (LIVE, READY, MODELS), "POST": (COMPLETIONS,)}
STATUS = {"bad_request": 400, "busy": 429, "deadline": 504, "worker_died": 503, "unavailable": 503, "internal": 500}
UNSUPPORTED = {"stream": False, "n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": None, "stop": None}


def parse_completion(body: dict, limits, model_ids: set[str]) -> tuple[str, GenerationSettings]:
    """An OpenAI completions request -> (prompt, settings); ServingError("bad_request") with OpenAI's wording."""
    def bad(message: str, param: str | None = None):
        error = ServingError("bad_request", message)
        error.param = param
        return error

    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model not in model_ids:
        error = bad(f"The model `{model}` does not exist; this server serves {', '.join(sorted(model_ids))}", "model")
        error.status, error.type = 404, "model_not_found"
        raise error
    for key, default in UNSUPPORTED.items():
        if body.get(key, default) not in (default, None) and not (key == "stop" and body.get(key) == []):
            raise bad(f"`{key}` is not supported by this server (use the default, {json.dumps(default)})", key)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt.strip():
        raise bad("`prompt` must be one non-empty string", "prompt")
    prompt = prompt.strip()
    if len(prompt) > limits.max_prompt_chars:
        raise bad(f"`prompt` has {len(prompt)} characters; the limit is {limits.max_prompt_chars}", "prompt")

    def number(key, kind, low, high, default):
        value = body.get(key, default)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise bad(f"`{key}` must be {'an integer' if kind is int else 'a number'}", key)
        if not low <= value <= high:
            raise bad(f"`{key}` must be in [{low}, {high}], got {value}", key)
        return kind(value)

    return prompt, GenerationSettings(
        max_new_tokens=number("max_tokens", int, 1, limits.max_new_tokens_limit, limits.default_max_new_tokens),
        temperature=number("temperature", float, 0.0, 10.0, 1.0),  # (OpenAI's default)
        top_k=number("top_k", int, 0, 1_000_000, 0), seed=number("seed", int, 0, 2**31 - 1, 0))


def error_body(error: ServingError) -> tuple[int, dict]:
    status = getattr(error, "status", STATUS[error.kind])
    kind = getattr(error, "type", "invalid_request_error" if error.kind == "bad_request" else error.kind)
    return status, {"error": {"message": error.message, "type": kind, "param": getattr(error, "param", None),
                              "code": error.kind}}


class ApiServer:
    def __init__(self, dispatcher, limits, meta: dict, metrics=None):
        self.dispatcher, self.limits, self.meta, self.metrics = dispatcher, limits, meta, metrics
        name, version = meta["registered_model_name"], str(meta["version"])
        self.model_ids = {name, f"{name}/{version}"}
        self.httpd: ThreadingHTTPServer | None = None

    def start(self, host: str, port: int) -> None:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: what HTTP client libraries expect
            # Headers and body leave in separate writes: with Nagle's algorithm on, the body waits for the client's
            # delayed ACK of the headers (~40 ms a response, measured).
            disable_nagle_algorithm = True

            def do_GET(self):
                api.get(self)

            def do_POST(self):
                api.post(self)

            def log_message(self, *args):  # (no line per request in server.log; metrics count them)
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, name="api", daemon=True).start()

    # -- routes -------------------------------------------------------------------------------------------------------
    def get(self, request) -> None:
        d = self.dispatcher
        if request.path == LIVE:
            alive = not d.fatal
            _reply(request, 200 if alive else 500, {"alive": alive, **({"reason": d.fatal} if d.fatal else {})})
        elif request.path == READY:
            ready = d.ready
            reason = "" if ready else ("draining" if d.draining else d.fatal or "no generation worker is ready")
            _reply(request, 200 if ready else 503, {"ready": ready, "model": self.meta["registered_model_name"],
                                                    "version": str(self.meta["version"]), "in_flight": d.in_flight,
                                                    **({"reason": reason} if reason else {})})
        elif request.path == MODELS:
            created = int(self.meta.get("created_at", 0) or 0)
            _reply(request, 200, {"object": "list", "data": [
                {"id": self.meta["registered_model_name"], "object": "model", "created": created,
                 "owned_by": "paddle-train-to-serve", "version": str(self.meta["version"]),
                 "source_run_id": self.meta["source_run_id"]}]})
        else:
            _reply(request, 404, {"error": {"message": f"no route GET {request.path}", "type": "invalid_request_error",
                                            "param": None, "code": "not_found"}})

    def post(self, request) -> None:
        if request.path != COMPLETIONS:
            _reply(request, 404, {"error": {"message": f"no route POST {request.path}", "type": "invalid_request_error",
                                            "param": None, "code": "not_found"}})
            return
        arrived = time.monotonic()
        try:
            body = _read_json(request, self.limits.max_request_bytes)
            prompt, settings = parse_completion(body, self.limits, self.model_ids)
            result = self.dispatcher.generate(prompt, settings)
        except ServingError as exc:
            if self.metrics:
                self.metrics.refused("openai", exc.kind)
            _reply(request, *error_body(exc))
            return
        if self.metrics:
            self.metrics.answered("openai", arrived, result)
        completion = len(result["token_ids"])
        _reply(request, 200, {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": body["model"],
            "choices": [{"text": result["text"], "index": 0, "logprobs": None,
                         "finish_reason": result["finish_reason"]}],
            "usage": {"prompt_tokens": result["prompt_tokens"], "completion_tokens": completion,
                      "total_tokens": result["prompt_tokens"] + completion}})


def _read_json(request, limit: int):
    try:
        size = int(request.headers.get("Content-Length", "0"))
    except ValueError:
        raise ServingError("bad_request", "bad Content-Length") from None
    if size > limit:
        raise ServingError("bad_request", f"the request body is {size} bytes; the limit is {limit}")
    try:
        return json.loads(request.rfile.read(size) or b"null")
    except ValueError as exc:
        raise ServingError("bad_request", f"the request body is not JSON ({exc})") from None


def _reply(request, status: int, body: dict) -> None:
    data = json.dumps(body, ensure_ascii=False).encode()
    request.send_response(status)
    request.send_header("Content-Type", "application/json")
    request.send_header("Content-Length", str(len(data)))
    request.end_headers()
    request.wfile.write(data)
