"""POST /v1/completions: an OpenAI completions request -> a protocol Request (serving/protocol.py)."""
from __future__ import annotations

from serving.protocol import Limits, Request, bad
from serving.server.openai import structured
from serving.server.openai.wire import check_body, openai_values, parse_openai, with_stream


def parse_completion(body, limits: Limits, model_ids: set[str], vocabulary=None) -> Request:
    """An OpenAI completions request -> a protocol Request (RequestError with OpenAI's wording otherwise), its
    grammar from `response_format` (serving/server/openai/structured.py)."""
    check_body(body, model_ids)
    structure = structured.structure(body, False, vocabulary)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is not None and not isinstance(prompt, str):
        raise bad("`prompt` must be one string", "prompt")
    request = parse_openai({**openai_values(body, chat=False), "prompt": prompt}, limits)
    return with_stream(request, body, structure)
