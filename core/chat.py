"""The chat template: part of a model's tokenizer, written once by fine-tuning and read by training (the loss mask),
export (copied with the tokenizer) and serving (the chat route renders requests with it).

Format: PaddleNLP 2.8.1's own, `chat_template.json` beside `vocab.txt` ({"system", "conversation": [user turn, answer
turn], "query"}, jinja), so PaddleNLP's tokenizer loads it too. It is rendered here, by one function (`_part`,
PaddleNLP's jinja settings) and nowhere else: `render` the prompt for an answer (the chat route; `apply_chat_template`'s text),
`training_pieces` the texts a training example is made of (`encode_chat_inputs`'s texts), and export/hf.py derives the
Hugging Face copy from the same template. tests/unit/test_chat.py checks both against PaddleNLP's own rendering on
every shape of conversation, and tests/unit/test_hf.py the HF copy against `render`.

The role markers are Chinese words whose characters the vocabulary has (用户 user, 助手 assistant, and the full-width
colon); each answer ends with the end-of-text token, so the model learns to stop. `missing_characters` checks a
vocabulary before a fine-tuning run starts.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from core.errors import ConfigError

TEMPLATE_FILE = "chat_template.json"
END = "[SEP]"  # core/tokenizer.py EOS_TOKEN (kept literal: the template is text)
USER, ASSISTANT = "用户：", "助手："
# System text first (when given), then each earlier turn as "用户：<user>\n助手：<answer>[SEP]", then the question.
TEMPLATE = {
    "system": "{% if system %}{{ system }}\n{% endif %}",
    "conversation": [USER + "{{ user }}\n" + ASSISTANT, "{{ bot }}" + END],
    "query": USER + "{{ query }}\n" + ASSISTANT,
}


def write(tokenizer_dir: Path | str, template: dict | None = None) -> None:
    (Path(tokenizer_dir) / TEMPLATE_FILE).write_text(json.dumps(template or TEMPLATE, ensure_ascii=False, indent=1),
                                                     encoding="utf-8")


def read(tokenizer_dir: Path | str) -> dict | None:
    """The tokenizer's chat template, or None (a base model: it has none)."""
    path = Path(tokenizer_dir) / TEMPLATE_FILE
    if not path.is_file():
        return None
    try:
        template = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConfigError(f"{path} is not JSON ({exc})") from None
    if not isinstance(template, dict) or not isinstance(template.get("conversation"), list) or \
            len(template["conversation"]) != 2:
        raise ConfigError(f"{path}: a chat template is {{\"system\", \"conversation\": [user, answer], \"query\"}}")
    return template


def missing_characters(template: dict, vocab: list[str]) -> list[str]:
    """The template's own characters (markers, not the slots) that the vocabulary lacks."""
    import re

    known = set(vocab)
    text = "".join([template.get("system") or "", *template["conversation"], template.get("query") or ""])
    text = re.sub(r"{%.*?%}|{{.*?}}", "", text).replace(END, "")
    return sorted({ch for ch in text if not ch.isspace() and ch not in known})


def conversation(messages: list[dict], answered: bool = False) -> tuple[str, list[list[str]]]:
    """OpenAI-style messages -> (system text, [[user, answer], ..., [question]]), PaddleNLP's conversation shape.

    System messages are joined into the system text; consecutive messages of one role are joined by a newline; a
    conversation that starts with the assistant gets an empty user turn before it. The last turn is the question
    (messages that end with an answer are refused: nothing to answer), or with `answered` (training data) the last
    answer."""
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    turns: list[list[str]] = []
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "system":
            continue
        if role not in ("user", "assistant"):
            raise ConfigError(f"message role {role!r}: one of system, user, assistant")
        if role == "user":
            if turns and len(turns[-1]) == 1:
                turns[-1][0] += "\n" + content
            else:
                turns.append([content])
        elif not turns:
            turns.append(["", content])
        elif len(turns[-1]) == 1:
            turns[-1].append(content)
        else:
            turns[-1][1] += "\n" + content
    if not turns or len(turns[-1]) != (2 if answered else 1):
        raise ConfigError("the conversation must end with an assistant message (the answer to learn)" if answered
                          else "the conversation must end with a user message (the question to answer)")
    return system, turns


def check_request(messages: list[dict]) -> None:
    """A chat request as a chat UI sends it, or ConfigError naming the first fault: system messages (if any) first,
    then user and assistant turns alternating from a user turn to a final user turn, every content non-empty.
    (Training data may repeat roles or start with the assistant: `conversation` joins those; a request that does
    is more likely a client's bug than a conversation, so the server refuses it.)"""
    previous = "system"
    for index, m in enumerate(messages):
        role, content = m["role"], m["content"]
        where = f"messages[{index}]"
        if role not in ("system", "user", "assistant"):
            raise ConfigError(f"{where}: unknown role {role!r}; one of system, user, assistant")
        if not content.strip():
            raise ConfigError(f"{where}: empty {role} content")
        expected = {"system": ("system", "user"), "user": ("assistant",), "assistant": ("user",)}[previous]
        if role not in expected:
            raise ConfigError(f"{where}: role {role!r} after {previous!r}; a conversation is system "
                              f"messages first, then user and assistant turns alternating, from a user turn")
        previous = role
    if previous != "user":
        raise ConfigError("the conversation must end with a user message (the question to answer)")


def _part(source: str, values: dict) -> str:
    """One part of the template rendered as PaddleNLP 2.8.1's ChatTemplate renders it (the same jinja settings)."""
    return _compiled(source).render(**values)


@functools.lru_cache(maxsize=64)
def _compiled(source: str):
    """A part compiled once (a template has three or four; compiling each time cost ~1 ms a conversation, the whole
    of fine-tuning's encoding of 17,000 reviews and every chat request)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    return env.from_string(source)


def render(template: dict, system: str, turns: list[list[str]]) -> str:
    """The prompt for the last turn's answer (PaddleNLP's ChatTemplate.__call__, 2.8.1)."""
    context = {"is_training": False, "system": system, "length": len(turns)}
    text = _part(template["system"], context) if template.get("system") else ""
    for index, (user, answer) in enumerate(turns[:-1]):
        values = {**context, "is_first": index == 0, "is_last": False, "user": user, "bot": answer, "index": index}
        text += "".join(_part(part, values) for part in template["conversation"])
    query = turns[-1][0]
    if template.get("query") is None:
        return text + query
    values = {**context, "is_first": len(turns) == 1, "is_last": False}
    return text + _part(template["query"], {"query": query, "index": len(turns) - 1, **values})


def training_pieces(template: dict, system: str, turns: list[list[str]]) -> list[str]:
    """An answered conversation's texts as training encodes them, each on its own (PaddleNLP's encode_chat_inputs,
    2.8.1): the system text ("" without one), then each turn's prompt and its answer."""
    context = {"is_training": False, "system": system}
    texts = [_part(template["system"], context) if template.get("system") else ""]
    for index, (user, answer) in enumerate(turns):
        values = {"user": user, "bot": answer, "index": index, **context, "is_first": index == 0,
                  "is_last": index == len(turns) - 1}
        texts += [_part(part, values) for part in template["conversation"]]
    return texts


def render_messages(template: dict, messages: list[dict]) -> str:
    system, turns = conversation(messages)
    return render(template, system, turns)
