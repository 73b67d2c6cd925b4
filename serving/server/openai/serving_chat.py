"""POST /v1/chat/completions: the messages rendered with the export's chat template (its tokenizer's
`chat_template`, else a plain default), then a protocol Request like a completion's."""
from __future__ import annotations

import json

from serving.protocol import Limits, Request, bad
from serving.server.openai.protocol import check_body, openai_values, parse_openai, with_stream

# A base model has no chat template of its own: this plain one is used (docs/serving.md "Chat").
DEFAULT_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")


def parse_chat(body, limits: Limits, model_ids: set[str], template: str) -> Request:
    """An OpenAI chat request -> a protocol Request whose prompt is the messages rendered by `template`."""
    check_body(body, model_ids)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise bad("`messages` must be a non-empty list of {role, content} objects with string content", "messages")
    prompt = render_chat(template, messages)
    return with_stream(parse_openai({**openai_values(body, chat=True), "prompt": prompt}, limits), body)


def render_chat(template: str, messages: list[dict]) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(keep_trailing_newline=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def chat_template(model_dir) -> str:
    """The export's tokenizer chat template (tokenizer_config.json `chat_template`), else DEFAULT_CHAT_TEMPLATE."""
    from pathlib import Path

    try:
        config = json.loads((Path(model_dir) / "tokenizer" / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_CHAT_TEMPLATE
    template = config.get("chat_template")
    return template if isinstance(template, str) and template else DEFAULT_CHAT_TEMPLATE
