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
OpenAI's chunk format, each chunk as the worker produces its tokens, ending with `data: [DONE]`; a client that
disconnects cancels its sequences (they leave the running batch at once). With serving.api_key (or PIPELINE_API_KEY)
set, the /v1 routes need `Authorization: Bearer <key>`.
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid

from fastapi import Request as HttpRequest  # (module level: FastAPI resolves the routes' annotations here)

from serving.protocol import Limits, Request, RequestError, bad, parse

LIVE, READY, MODELS, COMPLETIONS, CHAT = ("/health/live", "/health/ready", "/v1/models", "/v1/completions",
                                          "/v1/chat/completions")
RELOAD = "/admin/reload"  # follow the registry now (serving/entrypoints/follow.py)
ROUTES = {"GET": (LIVE, READY, MODELS), "POST": (COMPLETIONS, CHAT, RELOAD)}
# OpenAI's names -> the protocol's (serving/protocol.py); the rest are the same
RENAMED = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
IGNORED = ("user", "presence_penalty", "frequency_penalty", "logit_bias", "suffix", "best_of", "stream_options",
           "model", "stream", "messages", "prompt", "top_logprobs", "response_format", "tools", "tool_choice",
           "parallel_tool_calls", "service_tier", "store", "metadata")
# A base model has no chat template of its own: this plain one is used (docs/serving.md "Chat").
DEFAULT_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")


def openai_values(body: dict, chat: bool) -> dict:
    """An OpenAI request body -> the protocol's typed values (prompt rendered by the caller for chat)."""
    unsupported = {"suffix": None, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
                   "tools": None, "tool_choice": None}
    for key, default in unsupported.items():
        if body.get(key) not in (default, None, {}):
            raise bad(f"`{key}` is not supported by this server", key)
    values = {RENAMED.get(k, k): v for k, v in body.items() if k not in IGNORED}
    if values.get("temperature") is None:  # (absent or null: OpenAI's default; the key/value route's is 0, greedy)
        values["temperature"] = 1.0
    if chat:
        if "echo" in values:
            raise bad("`echo` is a completions option", "echo")
        if body.get("logprobs") is True:
            values["logprobs"] = body.get("top_logprobs") or 0
        elif body.get("logprobs") in (False, None):
            values.pop("logprobs", None)
        else:
            raise bad("`logprobs` must be true or false (chat)", "logprobs")
    if body.get("stream") and values.get("logprobs") is not None:
        raise bad("`logprobs` with `stream` is not supported by this server", "logprobs")
    return values


def _parse_openai(values: dict, limits: Limits) -> Request:
    """The protocol's checks, the parameter named as OpenAI names it (max_tokens)."""
    try:
        return parse(values, limits)
    except RequestError as exc:
        if exc.param == "max_new_tokens":
            raise RequestError(exc.kind, exc.message.replace("max_new_tokens", "max_tokens"), "max_tokens") from None
        raise


def parse_completion(body, limits: Limits, model_ids: set[str]) -> Request:
    """An OpenAI completions request -> a protocol Request (RequestError with OpenAI's wording otherwise)."""
    _check_body(body, model_ids)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is not None and not isinstance(prompt, str):
        raise bad("`prompt` must be one string", "prompt")
    request = _parse_openai({**openai_values(body, chat=False), "prompt": prompt}, limits)
    return _with_stream(request, body)


def parse_chat(body, limits: Limits, model_ids: set[str], template: str) -> Request:
    """An OpenAI chat request -> a protocol Request whose prompt is the messages rendered by `template`."""
    _check_body(body, model_ids)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise bad("`messages` must be a non-empty list of {role, content} objects with string content", "messages")
    prompt = render_chat(template, messages)
    return _with_stream(_parse_openai({**openai_values(body, chat=True), "prompt": prompt}, limits), body)


def render_chat(template: str, messages: list[dict]) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(keep_trailing_newline=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def _check_body(body, model_ids: set[str]) -> None:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if body.get("model") not in model_ids:
        raise RequestError("not_found", f"The model `{body.get('model')}` does not exist; this server serves "
                                        f"{', '.join(sorted(model_ids))}", "model")
    if not isinstance(body.get("stream", False), bool):
        raise bad("`stream` must be true or false", "stream")


def _with_stream(request: Request, body: dict) -> Request:
    from dataclasses import replace

    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("`stream_options` must be an object", "stream_options")
    return replace(request, stream=bool(body.get("stream")),
                   extra={"model": body["model"], "include_usage": bool(options.get("include_usage"))})


def error_body(error: RequestError) -> tuple[int, dict]:
    kind = "invalid_request_error" if error.kind == "bad_request" else (
        "model_not_found" if error.kind == "not_found" else error.kind)
    return error.status, {"error": {"message": error.message, "type": kind, "param": error.param,
                                    "code": error.kind}}


def chat_template(model_dir) -> str:
    """The export's tokenizer chat template (tokenizer_config.json `chat_template`), else DEFAULT_CHAT_TEMPLATE."""
    from pathlib import Path

    try:
        config = json.loads((Path(model_dir) / "tokenizer" / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_CHAT_TEMPLATE
    template = config.get("chat_template")
    return template if isinstance(template, str) and template else DEFAULT_CHAT_TEMPLATE


class ApiServer:
    def __init__(self, dispatcher, limits: Limits, metrics=None, model_dir=None, api_key: str = "", follower=None):
        self.dispatcher, self.limits, self.metrics, self.follower = dispatcher, limits, metrics, follower
        self.template = chat_template(model_dir) if model_dir else DEFAULT_CHAT_TEMPLATE
        self.api_key = api_key or os.environ.get("PIPELINE_API_KEY", "")
        self.server = None

    @property
    def meta(self) -> dict:
        """The model new requests go to (it changes when the server follows an alias: serving/entrypoints/follow.py)."""
        return self.dispatcher.meta

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

        @app.post(RELOAD)
        async def reload(request: HttpRequest):
            return JSONResponse(await self._reload(request))

        @app.post(COMPLETIONS)
        async def completions(request: HttpRequest):
            return await self._serve(request, chat=False)

        @app.post(CHAT)
        async def chat(request: HttpRequest):
            return await self._serve(request, chat=True)

        @app.exception_handler(RequestError)
        async def refused(request, exc: RequestError):
            if self.metrics:
                self.metrics.refused("openai", exc.kind)
            return JSONResponse(*reversed(error_body(exc)))

        @app.exception_handler(404)
        async def no_route(request, exc):
            return JSONResponse({"error": {"message": f"no route {request.method} {request.url.path}",
                                           "type": "invalid_request_error", "param": None, "code": "not_found"}}, 404)

        @app.exception_handler(405)
        async def wrong_method(request, exc):
            return JSONResponse({"error": {"message": f"no route {request.method} {request.url.path}",
                                           "type": "invalid_request_error", "param": None, "code": "not_found"}}, 404)

        return app

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
        body = await _read_json(http_request, self.limits.max_request_bytes)
        request = (parse_chat(body, self.limits, self.model_ids, self.template) if chat
                   else parse_completion(body, self.limits, self.model_ids))
        run = Generation(self.dispatcher, request)
        if request.stream:
            return StreamingResponse(self._events(run, chat, arrived), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        results = await run.all()
        for result in results:
            if self.metrics:
                self.metrics.answered("openai", arrived, result)
        return JSONResponse(completion_body(request, results, chat))

    async def _events(self, run: "Generation", chat: bool, arrived: float):
        """OpenAI's chunks as the worker's text arrives; cancels the sequences if the client goes away."""
        request = run.request
        ident, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
            body = {"id": ident, "object": kind, "created": created, "model": request.extra["model"],
                    "system_fingerprint": fingerprint(run.tickets[index].worker.lineage), "choices": [choice]}
            if request.extra["include_usage"]:
                body["usage"] = None
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        results: dict[int, dict] = {}
        try:
            await run.start()
            for index in range(request.n):
                if chat:
                    yield chunk(index, None, None, role=True)
                elif request.echo:
                    yield chunk(index, request.prompt, None)
            async for index, event, value in run.events():
                if event == "delta":
                    yield chunk(index, value, None)
                elif event == "done":
                    results[index] = value
                    rest = value["text"][value.get("streamed", 0):]
                    yield chunk(index, rest or None, value["finish_reason"])
        except RequestError as exc:
            if self.metrics:
                self.metrics.refused("openai", exc.kind)
            yield f"data: {json.dumps(error_body(exc)[1], ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
            return
        finally:
            run.cancel()  # (client gone, or an error: whatever still runs leaves its batch)
        for result in results.values():
            if self.metrics:
                self.metrics.answered("openai", arrived, result)
        if request.extra["include_usage"]:
            usage = usage_of(request, list(results.values()))
            yield f"data: {json.dumps({'id': ident, 'object': kind, 'created': created, 'model': request.extra['model'], 'choices': [], 'usage': usage})}\n\n"  # noqa: E501
        yield "data: [DONE]\n\n"


class Generation:
    """The n sequences of one request on the dispatcher, seen from the event loop: their events arrive on the
    workers' reader threads and are handed over with call_soon_threadsafe."""

    def __init__(self, dispatcher, request: Request):
        self.dispatcher, self.request = dispatcher, request
        self.tickets: list = []
        self.queue: asyncio.Queue | None = None
        self.deadline = time.monotonic() + request.timeout_s

    async def start(self) -> None:
        loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()
        for i in range(self.request.n):
            def on_event(event, i=i):
                loop.call_soon_threadsafe(self.queue.put_nowait, (i, *event))
            try:
                self.tickets.append(self.dispatcher.submit(self.request.prompt, self.request.choice_settings(i),
                                                           self.request.timeout_s, on_event, self.request.stream))
            except RequestError:
                self.cancel()
                raise

    async def events(self):
        """(choice, "delta", text) ... (choice, "done", result) for every choice; RequestError on an error or at
        the deadline."""
        open_choices = set(range(self.request.n))
        while open_choices:
            left = self.deadline - time.monotonic()
            try:
                index, event, value = await asyncio.wait_for(self.queue.get(), max(left, 0.0))
            except asyncio.TimeoutError:
                from serving.engine.dispatch import deadline_error

                raise deadline_error(self.request.timeout_s) from None
            if event == "error":
                raise value
            if event == "done":
                open_choices.discard(index)
            yield index, event, value

    async def all(self) -> list[dict]:
        await self.start()
        results: dict[int, dict] = {}
        try:
            async for index, event, value in self.events():
                if event == "done":
                    results[index] = value
        finally:
            self.cancel()
        return [results[i] for i in range(self.request.n)]

    def cancel(self) -> None:
        for ticket in self.tickets:
            if not ticket.pending.done.is_set():
                self.dispatcher.cancel(ticket)


def usage_of(request: Request, results: list[dict]) -> dict:
    completion = sum(len(r["token_ids"]) for r in results)
    prompt = results[0]["prompt_tokens"] if results else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_body(request: Request, results: list[dict], chat: bool) -> dict:
    prefix = request.prompt if request.echo else ""
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": r["text"]},
                    "logprobs": chat_logprobs(r.get("logprobs")), "finish_reason": r["finish_reason"]}
                   for i, r in enumerate(results)]
    else:
        choices = [{"text": prefix + r["text"], "index": i, "logprobs": r.get("logprobs"),
                    "finish_reason": r["finish_reason"]} for i, r in enumerate(results)]
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": request.extra["model"], "system_fingerprint": fingerprint(results[0]["lineage"]),
            "lineage": results[0]["lineage"], "choices": choices, "usage": usage_of(request, results)}


def fingerprint(lineage: dict) -> str:
    """OpenAI's `system_fingerprint`: which model version generated the answer (`<name>/<version>`)."""
    return f"{lineage.get('model_name', '')}/{lineage.get('model_version', '')}"


def chat_logprobs(logprobs: dict | None):
    if logprobs is None:
        return None
    return {"content": [{"token": token, "logprob": lp,
                         "top_logprobs": [{"token": t, "logprob": v} for t, v in top.items()]}
                        for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                                  logprobs["top_logprobs"])]}


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
