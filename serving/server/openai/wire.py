"""OpenAI's request and response shapes, turned into the one request protocol (serving/protocol.py) and back:
renamed and ignored fields, unsupported options refused, errors in OpenAI's error body, usage and the fingerprint."""
from __future__ import annotations

import time
import uuid
from dataclasses import replace

from serving.protocol import Limits, Request, RequestError, bad, parse
from serving.server.openai.structured import tool_calls

# OpenAI's names -> the protocol's (serving/protocol.py); the rest are the same
RENAMED = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
IGNORED = ("user", "presence_penalty", "frequency_penalty", "logit_bias", "suffix", "best_of", "stream_options",
           "model", "stream", "messages", "prompt", "top_logprobs", "response_format", "tools", "tool_choice",
           "parallel_tool_calls", "service_tier", "store", "metadata")

def openai_values(body: dict, chat: bool) -> dict:
    """An OpenAI request body -> the protocol's typed values (prompt rendered by the caller for chat)."""
    unsupported = {"suffix": None, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None}
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
    return values


def parse_openai(values: dict, limits: Limits) -> Request:
    """The protocol's checks, the parameter named as OpenAI names it (max_tokens)."""
    try:
        return parse(values, limits)
    except RequestError as exc:
        if exc.param == "max_new_tokens":
            raise RequestError(exc.kind, exc.message.replace("max_new_tokens", "max_tokens"), "max_tokens") from None
        raise


def check_body(body, model_ids: set[str]) -> None:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if body.get("model") not in model_ids:
        raise RequestError("not_found", f"The model `{body.get('model')}` does not exist; this server serves "
                                        f"{', '.join(sorted(model_ids))}", "model")
    if not isinstance(body.get("stream", False), bool):
        raise bad("`stream` must be true or false", "stream")


def with_stream(request: Request, body: dict, structure=None) -> Request:
    """The request with its stream options, and its structure (serving/server/openai/structured.py): the grammar
    in its settings, whether its answer is read back as tool calls."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("`stream_options` must be an object", "stream_options")
    if structure is not None and structure.grammar:
        request = replace(request, settings=replace(request.settings, grammar=structure.grammar))
    return replace(request, stream=bool(body.get("stream")),
                   extra={"model": body["model"], "include_usage": bool(options.get("include_usage")),
                          "tool_calls": bool(structure and structure.calls)})


def error_body(error: RequestError) -> tuple[int, dict]:
    kind = "invalid_request_error" if error.kind == "bad_request" else (
        "model_not_found" if error.kind == "not_found" else error.kind)
    return error.status, {"error": {"message": error.message, "type": kind, "param": error.param,
                                    "code": error.kind}}


def usage_of(request: Request, results: list[dict]) -> dict:
    completion = sum(len(r["token_ids"]) for r in results)
    prompt = results[0]["prompt_tokens"] if results else 0
    cached = results[0].get("cached_tokens", 0) if results else 0  # (of the first choice: the prompt is one)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_body(request: Request, results: list[dict], chat: bool) -> dict:
    prefix = request.prompt if request.echo else ""
    if chat:
        choices = [{"index": i, **chat_message(request, r), "logprobs": chat_logprobs(r.get("logprobs"))}
                   for i, r in enumerate(results)]
    else:
        choices = [{"text": prefix + r["text"], "index": i, "logprobs": r.get("logprobs"),
                    "finish_reason": r["finish_reason"]} for i, r in enumerate(results)]
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": request.extra["model"], "system_fingerprint": fingerprint(results[0]["lineage"]),
            "lineage": results[0]["lineage"], "choices": choices, "usage": usage_of(request, results)}


def chat_message(request: Request, result: dict) -> dict:
    """A chat answer's message and finish reason: its text, or (a request with tools) the tool calls it wrote."""
    calls = tool_calls(result["text"]) if request.extra.get("tool_calls") else None
    if calls:
        return {"message": {"role": "assistant", "content": None, "tool_calls": calls}, "finish_reason": "tool_calls"}
    return {"message": {"role": "assistant", "content": result["text"]}, "finish_reason": result["finish_reason"]}


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
