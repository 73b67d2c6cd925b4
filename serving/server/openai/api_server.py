"""The server's own HTTP routes (`serving.api_port`), next to Paddle Serving's endpoint and in front of the same
generation workers: FastAPI on uvicorn (what vLLM's OpenAI server runs on), in a thread of the server process.

    GET  /health/live          200 while the server and its worker manager are up (a liveness probe)
    GET  /health/ready         200 when a worker is loaded and answered a tiny generation, 503 otherwise
    GET  /v1/models            the served model, OpenAI's list shape
    POST /v1/completions       OpenAI's completions API
    POST /v1/chat/completions  OpenAI's chat API: the messages rendered with the export's chat template

Both POST routes take prompt/messages, max_tokens, temperature (default 1, as OpenAI), top_p, top_k, seed, stop, n,
logprobs (completions; chat: logprobs + top_logprobs), echo (completions), stream (+ stream_options.include_usage):
the same checks as every other entry point (serving/protocol.py). `stream: true` answers Server-Sent Events in
OpenAI's chunk format, each chunk as the worker produces its tokens (with their logprobs when asked: joined, the
unstreamed answer's), ending with `data: [DONE]`; a client that
disconnects cancels its sequences (they leave the running batch at once). With serving.api_key (or PIPELINE_API_KEY)
set, the /v1 routes need `Authorization: Bearer <key>`.
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time

from fastapi import Request as HttpRequest  # (module level: FastAPI resolves the routes' annotations here)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from serving.protocol import ROUTED_MODEL_HEADER, USAGE_HEADER, VERSION_HEADERS, Limits, RequestError, bad
from serving.server.consumers import DIRECT, TokenBudgets, consumer_of
from serving.server.openai.wire import completion_body, error_body, usage_of
from serving.server.openai.serving_chat import chat_template, parse_chat
from serving.server.openai.serving_completion import parse_completion
from serving.server.openai.streaming import Generation, sse_events
from core import exportdir
from serving.engine.constraints import Vocabulary

LIVE, READY, MODELS, COMPLETIONS, CHAT = ("/health/live", "/health/ready", "/v1/models", "/v1/completions",
                                          "/v1/chat/completions")
METRICS = "/metrics"  # the metrics port's page here too: scrapers that reach only the replica's API port
RELOAD = "/admin/reload"  # follow the registry now (serving/server/follow.py)
ROUTES = {"GET": (LIVE, READY, MODELS, METRICS), "POST": (COMPLETIONS, CHAT, RELOAD)}

class ApiServer:
    def __init__(self, dispatcher, limits: Limits, metrics=None, model_dir=None, api_key: str = "", follower=None):
        self.dispatcher, self.limits, self.metrics, self.follower = dispatcher, limits, metrics, follower
        self.model_dir = model_dir
        self._templates: dict = {}  # export directory -> its chat template (the served one changes when following)
        self._vocabularies: dict = {}  # export directory -> its tokens (serving/engine/constraints.py Vocabulary)
        self.api_key = api_key or os.environ.get("PIPELINE_API_KEY", "")
        self.budgets = TokenBudgets()  # tokens per consumer in the last minute (serving/server/consumers.py)
        self.server = None

    @property
    def meta(self) -> dict:
        """The model new requests go to (it changes when the server follows an alias: serving/server/follow.py)."""
        return self.dispatcher.meta

    @property
    def served_dir(self):
        """The export directory new requests go to (it changes when the server follows an alias)."""
        return getattr(self.dispatcher, "model_dir", None) or self.model_dir

    @property
    def template(self) -> dict | None:
        """The chat template of the model new requests go to."""
        model_dir = self.served_dir
        if model_dir is None:
            return None
        if str(model_dir) not in self._templates:
            self._templates[str(model_dir)] = chat_template(model_dir)
        return self._templates[str(model_dir)]

    @property
    def vocabulary(self):
        """The tokens of the model new requests go to, as a request's grammar is checked against them (built at the
        first constrained request: serving/engine/constraints.py Vocabulary)."""
        model_dir = self.served_dir
        if model_dir is None:
            return None
        if str(model_dir) not in self._vocabularies:
            self._vocabularies[str(model_dir)] = Vocabulary(exportdir.tokenizer_dir(model_dir),
                                                            int(self.meta["eos_token_id"]))
        return self._vocabularies[str(model_dir)]

    @property
    def version_headers(self) -> dict[str, str]:
        """Which model version answers (X-Model-Name, X-Model-Version, X-Source-Run)."""
        m = self.meta
        return dict(zip(VERSION_HEADERS, (m["registered_model_name"], str(m["version"]), m["source_run_id"])))

    @property
    def model_label(self) -> str:
        return f"{self.meta['registered_model_name']}/{self.meta['version']}"

    @property
    def model_ids(self) -> set[str]:
        name, version = self.meta["registered_model_name"], str(self.meta["version"])
        return {name, f"{name}/{version}"}

    def app(self):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        app = FastAPI(title="paddle-train-to-serve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get(LIVE)
        def live():
            d = self.dispatcher
            return JSONResponse({"alive": not d.fatal, **({"reason": d.fatal} if d.fatal else {})},
                                200 if not d.fatal else 500)

        @app.get(READY)
        def ready():
            d = self.dispatcher
            ok = d.ready
            reason = "" if ok else ("draining" if d.draining else d.fatal or "no generation worker is ready")
            return JSONResponse({"ready": ok, "model": self.meta["registered_model_name"],
                                 "version": str(self.meta["version"]), "in_flight": d.in_flight,
                                 **({"reason": reason} if reason else {})}, 200 if ok else 503)

        @app.get(MODELS)
        def models(request: HttpRequest):
            self._authorize(request)
            return {"object": "list", "data": [
                {"id": self.meta["registered_model_name"], "object": "model",
                 "created": int(self.meta.get("created_at", 0) or 0), "owned_by": "paddle-train-to-serve",
                 "version": str(self.meta["version"]), "source_run_id": self.meta["source_run_id"]}]}

        @app.get(METRICS)
        def metrics_page():
            from fastapi.responses import Response

            if self.metrics is None:
                return Response("", media_type=CONTENT_TYPE_LATEST)
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.post(RELOAD)
        async def reload(request: HttpRequest):
            return JSONResponse(await self._reload(request))

        @app.post(COMPLETIONS)
        async def completions(request: HttpRequest):
            return await self._serve(request, chat=False)

        @app.post(CHAT)
        async def chat(request: HttpRequest):
            return await self._serve(request, chat=True)

        self._error_handlers(app)
        return app

    def _error_handlers(self, app) -> None:
        """RequestError in OpenAI's error shape (429s with Retry-After when known); unknown routes 404."""
        from fastapi.responses import JSONResponse

        @app.exception_handler(RequestError)
        async def refused(request, exc: RequestError):
            if self.metrics:
                self.metrics.refused("openai", exc.kind)
                if request.url.path in (COMPLETIONS, CHAT):
                    self.metrics.consumer_requests.labels(consumer_of(request.headers)[0], self.model_label,
                                                          exc.kind).inc()
            headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
            return JSONResponse(*reversed(error_body(exc)), headers=headers)

        @app.exception_handler(404)
        async def no_route(request, exc):
            return JSONResponse({"error": {"message": f"no route {request.method} {request.url.path}",
                                           "type": "invalid_request_error", "param": None, "code": "not_found"}}, 404)

        @app.exception_handler(405)
        async def wrong_method(request, exc):
            return JSONResponse({"error": {"message": f"no route {request.method} {request.url.path}",
                                           "type": "invalid_request_error", "param": None, "code": "not_found"}}, 404)

    def start(self, host: str, port: int) -> None:
        import uvicorn

        config = uvicorn.Config(self.app(), host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off", timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        thread = threading.Thread(target=self.server.run, name="api", daemon=True)  # (not the main thread: no
        thread.start()  # signal handlers; the server process's own SIGTERM handling drains)
        deadline = time.monotonic() + 30
        while not self.server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError(f"the OpenAI-compatible route could not listen on {host}:{port}")

    # -- the POST routes ------------------------------------------------------------------------------------------
    async def _reload(self, request) -> dict:
        """Resolve the served reference again and switch if it moved (the answer says what is served now)."""
        self._authorize(request)
        if self.follower is None:
            raise bad("this server serves a fixed export directory; start it with MODEL=models:/<name>@<alias> "
                      "(or /latest) to follow the registry")
        return await asyncio.get_running_loop().run_in_executor(None, self.follower.check)

    def _authorize(self, request) -> None:
        if self.api_key and request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            raise RequestError("unauthorized", "missing or wrong API key: send `Authorization: Bearer <key>`")

    async def _serve(self, http_request, chat: bool):
        from fastapi.responses import JSONResponse, StreamingResponse

        arrived = time.monotonic()
        self._authorize(http_request)
        consumer, budget = consumer_of(http_request.headers)
        self.budgets.check(consumer, budget)
        body = await _read_json(http_request, self.limits.max_request_bytes)
        # (a name the gateway routed here, gateway.models: an alias such as name@challenger is the gateway's to know)
        routed = http_request.headers.get(ROUTED_MODEL_HEADER, "")
        ids = self.model_ids | ({routed} if routed else set())
        vocabulary = self.vocabulary if _constrained(body) else None
        request = (parse_chat(body, self.limits, ids, self.template, vocabulary) if chat
                   else parse_completion(body, self.limits, ids, vocabulary))
        request.extra["consumer"] = "" if consumer == DIRECT else consumer  # (part of the prefix cache's key)
        run = Generation(self.dispatcher, request)
        headers, model = self.version_headers, self.model_label

        def spend(usage: dict) -> None:  # (every answer's `usage`, for its consumer)
            self.budgets.spend(consumer, usage["total_tokens"])
            if self.metrics:
                self.metrics.consumed(consumer, model, usage)

        gateway = consumer != DIRECT  # (a request through the gateway: its log gets the usage, USAGE_HEADER)
        if request.stream:
            return StreamingResponse(sse_events(run, chat, arrived, self.metrics, spend, usage_comment=gateway),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
        results = await run.all()
        for result in results:
            if self.metrics:
                self.metrics.answered("openai", arrived, result)
        usage = usage_of(request, results)
        spend(usage)
        if gateway:
            headers = {**headers, USAGE_HEADER: f"{usage['prompt_tokens']} {usage['completion_tokens']}"}
        return JSONResponse(completion_body(request, results, chat), headers=headers)


def _constrained(body) -> bool:
    """Whether a request may need the model's vocabulary (a grammar to check): response_format or tools."""
    return isinstance(body, dict) and (body.get("response_format") not in (None, {"type": "text"}) or
                                       bool(body.get("tools")))


async def _read_json(request, limit: int):
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > limit):
        raise bad(f"the request body is {size} bytes; the limit is {limit}" if size.isdigit() else
                  "bad Content-Length")
    raw = await request.body()
    if len(raw) > limit:
        raise bad(f"the request body is {len(raw)} bytes; the limit is {limit}")
    try:
        return json.loads(raw or b"null")
    except ValueError as exc:
        raise bad(f"the request body is not JSON ({exc})") from None
