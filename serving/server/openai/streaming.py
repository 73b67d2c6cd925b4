"""A request's n sequences on the dispatcher, seen from the event loop (their events arrive on the workers' reader
threads), and OpenAI's Server-Sent Events over them."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from serving.protocol import USAGE_COMMENT, Request, RequestError
from core.chat import TOOL_CLOSE, TOOL_OPEN
from serving.server.openai.wire import chat_logprobs, error_body, fingerprint, usage_of
from serving.server.openai.structured import tool_calls


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
                                                           self.request.timeout_s, on_event, self.request.stream,
                                                           self.request.extra.get("consumer", "")))
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


def _rest(result: dict) -> dict | None:
    """A finished sequence's logprobs not yet streamed (the tokens after the last delta)."""
    if "logprobs" not in result:
        return None
    start = result.get("streamed_logprobs", 0)
    return {key: values[start:] for key, values in result["logprobs"].items()}


async def sse_events(run: "Generation", chat: bool, arrived: float, metrics=None, spend=None,
                     usage_comment: bool = False):
    """OpenAI's chunks as the worker's text arrives; cancels the sequences if the client goes away. `spend` gets the
    finished stream's `usage` (whether or not the client asked to be sent it); `usage_comment`: it is also the
    stream's last comment line, for the gateway's log (serving/protocol.py USAGE_COMMENT)."""
    request = run.request
    ident, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, text: str | None, finish: str | None, role: bool = False, logprobs=None,
              delta: dict | None = None) -> str:
        if chat:
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs), "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        body = {"id": ident, "object": kind, "created": created, "model": request.extra["model"],
                "system_fingerprint": fingerprint(run.tickets[index].worker.lineage), "choices": [choice]}
        if request.extra["include_usage"]:
            body["usage"] = None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    results: dict[int, dict] = {}
    calls = {i: CallStream() for i in range(request.n)} if request.extra.get("tool_calls") else None
    try:
        await run.start()
        for index in range(request.n):
            if chat:
                yield chunk(index, None, None, role=True)
            elif request.echo:
                yield chunk(index, request.prompt, None)
        async for index, event, value in run.events():
            if event == "done":
                results[index] = value
            for text in _chunks_of(chunk, index, event, value, calls[index] if calls else None):
                yield text
    except RequestError as exc:
        if metrics:
            metrics.refused("openai", exc.kind)
        yield f"data: {json.dumps(error_body(exc)[1], ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
        return
    finally:
        run.cancel()  # (client gone, or an error: whatever still runs leaves its batch)
    for result in results.values():
        if metrics:
            metrics.answered("openai", arrived, result)
    usage = usage_of(request, list(results.values()))
    if spend:
        spend(usage)
    if request.extra["include_usage"]:
        yield f"data: {json.dumps({'id': ident, 'object': kind, 'created': created, 'model': request.extra['model'], 'choices': [], 'usage': usage})}\n\n"  # noqa: E501
    if usage_comment:
        yield f"{USAGE_COMMENT} {usage['prompt_tokens']} {usage['completion_tokens']}\n\n"
    yield "data: [DONE]\n\n"


def _chunks_of(chunk, index: int, event: str, value: dict, calls: "CallStream | None") -> list[str]:
    """The chunks of one event of a choice: its new text (or, an answer that may be tool calls, what `calls` lets
    out), and at its end the rest with the finish reason."""
    if event == "delta":
        if calls is not None:
            return [chunk(index, None, None, delta=delta) for delta in calls.feed(value["text"])]
        return [chunk(index, value["text"], None, logprobs=value["logprobs"])]
    rest = value["text"][value.get("streamed", 0):]
    if calls is None:
        return [chunk(index, rest or None, value["finish_reason"], logprobs=_rest(value))]
    return [*(chunk(index, None, None, delta=delta) for delta in calls.feed(rest, final=True)),
            chunk(index, None, "tool_calls" if calls.count else value["finish_reason"], delta={})]


class CallStream:
    """One chat choice's stream when its answer may be tool calls (serving/server/openai/structured.py): text that
    does not begin with a call goes out as content as it comes; calls go out as OpenAI streams them, each as its
    name (with its id) and then its arguments, once the call is complete."""

    def __init__(self):
        self.buffer, self.mode, self.count = "", None, 0

    def feed(self, text: str, final: bool = False) -> list[dict]:
        self.buffer += text
        if self.mode is None and self.buffer:
            self.mode = "calls" if self.buffer.startswith(TOOL_OPEN[:len(self.buffer)]) else "text"
        out = []
        while self.mode == "calls" and TOOL_CLOSE in self.buffer:
            head, self.buffer = self.buffer.split(TOOL_CLOSE, 1)
            call = tool_calls(head + TOOL_CLOSE)
            if call is None:  # (not a call after all: the rest is text)
                self.buffer, self.mode = head + TOOL_CLOSE + self.buffer, "text"
                break
            function = call[0]["function"]
            out += [{"tool_calls": [{"index": self.count, "id": call[0]["id"], "type": "function",
                                     "function": {"name": function["name"], "arguments": ""}}]},
                    {"tool_calls": [{"index": self.count, "function": {"arguments": function["arguments"]}}]}]
            self.count += 1
        if self.mode == "text" or (final and self.buffer):
            out += [{"content": self.buffer}] if self.buffer else []
            self.buffer, self.mode = "", "text"
        return out
