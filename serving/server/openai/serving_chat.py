"""POST /v1/chat/completions: the messages rendered with the model's chat template (its tokenizer's
`chat_template.json`, core/chat.py: the template it was fine-tuned with), then a protocol Request like a
completion's. A model without one (a base model: it continues text) answers 400 on this route and keeps answering
on /v1/completions: a made-up template would give empty or off-topic answers that look like a working chat
(docs/serving.md "Chat")."""
from __future__ import annotations

from pathlib import Path
import json

from core import chat
from core.errors import ConfigError
from serving.protocol import Limits, Request, bad
from serving.server.openai import structured
from serving.server.openai.wire import check_body, openai_values, parse_openai, with_stream

NO_TEMPLATE = ("this model has no chat template (a base model: it continues text); use /v1/completions, or serve a "
               "fine-tuned version (make finetune)")


def parse_chat(body, limits: Limits, model_ids: set[str], template: dict | None, vocabulary=None) -> Request:
    """An OpenAI chat request -> a protocol Request whose prompt is the messages (and tools) rendered by `template`,
    its grammar from `response_format` / `tools` (serving/server/openai/structured.py)."""
    check_body(body, model_ids)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(map(_well_formed, messages)):
        raise bad("`messages` must be a non-empty list of {role, content} objects with string content (an "
                  "assistant's may be null with `tool_calls` [{id, type: function, function: {name, arguments}}])",
                  "messages")
    if template is None:
        raise bad(NO_TEMPLATE, "messages")
    structure = structured.structure(body, True, vocabulary)
    try:
        chat.check_request(messages)
        prompt = chat.render_messages(template, messages, list(structure.tools))
    except ConfigError as exc:
        raise bad(str(exc), "messages") from None
    if len(prompt) > limits.max_prompt_chars:  # (refused, not cut: docs/serving.md "Chat")
        raise bad(f"the conversation is {len(prompt)} characters with the chat template; the limit is "
                  f"serving.max_prompt_chars={limits.max_prompt_chars}: drop the oldest turns or start a new "
                  f"conversation", "messages")
    return with_stream(parse_openai({**openai_values(body, chat=True), "prompt": prompt}, limits), body, structure)


def _well_formed(message) -> bool:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return False
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) and
                isinstance(c["function"].get("name"), str) and _json_text(c["function"].get("arguments"))
                for c in calls):
            return False
        return message.get("content") is None or isinstance(message.get("content"), str)
    return isinstance(message.get("content"), str)


def _json_text(value) -> bool:
    try:
        return isinstance(value, str) and isinstance(json.loads(value or "{}"), dict)
    except ValueError:
        return False


def chat_template(model_dir) -> dict | None:
    """The export's chat template (tokenizer/chat_template.json), or None."""
    try:
        return chat.read(Path(model_dir) / "tokenizer")
    except ConfigError:
        return None
