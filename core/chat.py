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
from dataclasses import dataclass
from pathlib import Path
import re

from core.errors import ConfigError
from core.tokenizer import special_token

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


@dataclass(frozen=True)
class HFChatTemplate:
    """A model's own chat template: tokenizer_config.json's `chat_template` (jinja over `messages`, as transformers'
    apply_chat_template renders it) with the special tokens it may name."""

    source: str
    bos_token: str = ""
    eos_token: str = ""


# A model's own tokenizer without a chat template gets this one, in its tokenizer_config.json (training/finetune/
# data.py): this project's markers, each answer ended by the model's end-of-text token.
HF_DEFAULT = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n"
              "{% elif m['role'] == 'user' %}" + USER + "{{ m['content'] }}\n" + ASSISTANT +
              "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def read(tokenizer_dir: Path | str) -> dict | HFChatTemplate | None:
    """The tokenizer's chat template, or None (a base model: it has none): this project's chat_template.json, or a
    model's own (tokenizer_config.json's chat_template, beside its tokenizer.json)."""
    path = Path(tokenizer_dir) / TEMPLATE_FILE
    if not path.is_file():
        return _hf_template(Path(tokenizer_dir))
    try:
        template = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConfigError(f"{path} is not JSON ({exc})") from None
    if not isinstance(template, dict) or not isinstance(template.get("conversation"), list) or \
            len(template["conversation"]) != 2:
        raise ConfigError(f"{path}: a chat template is {{\"system\", \"conversation\": [user, answer], \"query\"}}")
    return template


def _hf_template(directory: Path) -> HFChatTemplate | None:
    settings_path = directory / "tokenizer_config.json"
    if not (directory / "tokenizer.json").is_file() or not settings_path.is_file():
        return None
    try:
        settings = json.loads(settings_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConfigError(f"{settings_path} is not JSON ({exc})") from None
    source = settings.get("chat_template")
    if isinstance(source, list):  # (several named templates: the default one)
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        return None

    return HFChatTemplate(source, special_token(settings, "bos_token"), special_token(settings, "eos_token"))


def write_hf(tokenizer_dir: Path | str, source: str = HF_DEFAULT) -> HFChatTemplate:
    """A chat template into a model's own tokenizer (its tokenizer_config.json's chat_template)."""
    path = Path(tokenizer_dir) / "tokenizer_config.json"
    settings = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    settings["chat_template"] = source
    path.write_text(json.dumps(settings, ensure_ascii=False, indent=1), encoding="utf-8")
    return _hf_template(Path(tokenizer_dir))


def missing_characters(template: dict, vocab: list[str]) -> list[str]:
    """The template's own characters (markers, not the slots) that the vocabulary lacks."""
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


# What follows an assistant's tool calls: the tools' results, one `tool` message per call, then the answer
_NEXT = {"system": ("system", "user"), "user": ("assistant",), "assistant": ("user",), "calls": ("tool",),
         "tool": ("tool", "assistant", "user")}


def check_request(messages: list[dict]) -> None:
    """A chat request as a chat UI or an agent loop sends it, or ConfigError naming the first fault: system messages
    (if any) first, then user and assistant turns alternating from a user turn; an assistant turn with `tool_calls`
    (content null or text) is followed by its `tool` results, then the assistant answers (or the user goes on); the
    conversation ends with a user turn or tool results, every text content non-empty. (Training data may repeat
    roles or start with the assistant: `conversation` joins those; a request that does is more likely a client's
    bug than a conversation, so the server refuses it.)"""
    previous = "system"
    for index, m in enumerate(messages):
        role, content, where = m["role"], m.get("content"), f"messages[{index}]"
        if role not in ("system", "user", "assistant", "tool"):
            raise ConfigError(f"{where}: unknown role {role!r}; one of system, user, assistant, tool")
        calls = role == "assistant" and bool(m.get("tool_calls"))
        if not calls and not (content or "").strip():
            raise ConfigError(f"{where}: empty {role} content")
        if role not in _NEXT[previous]:
            raise ConfigError(f"{where}: role {role!r} after {previous!r}; a conversation is system messages "
                              f"first, then user and assistant turns alternating, from a user turn (an assistant's "
                              f"tool calls followed by their tool results)")
        previous = "calls" if calls else role
    if previous not in ("user", "tool"):
        raise ConfigError("the conversation must end with a user message (the question to answer) or tool results")


TOOLS_HEADER, TOOL_RESULT = "可用工具：", "工具结果："
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"  # (Qwen2's and Hermes' markers, without their newlines)


def tool_call_text(name: str, arguments) -> str:
    """One tool call as the model writes it: <tool_call>{"name":...,"arguments":{...}}</tool_call>, compact JSON
    (the default vocabulary has no whitespace)."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments or "{}")
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, separators=(",", ":"))
    return TOOL_OPEN + body + TOOL_CLOSE


def plain_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """A conversation with tools in the shape this project's own template renders (system, user and assistant
    texts): the tools' definitions after the system text, an assistant's tool calls as its text, each tool's result
    as a user turn ("工具结果：..."), consecutive results joined by `conversation`."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": TOOL_RESULT + (m.get("content") or "")})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            text = "".join(tool_call_text(c["function"]["name"], c["function"].get("arguments") or "{}")
                           for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m.get("content") or "") + text})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:  # (after the system texts)
        listed = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False, separators=(",", ":"))
        at = next((i for i, m in enumerate(out) if m["role"] != "system"), len(out))
        out.insert(at, {"role": "system", "content": TOOLS_HEADER + listed})
    return out


def _hf_messages(messages: list[dict]) -> list[dict]:
    """Messages as Hugging Face templates read them: tool calls' arguments as objects (OpenAI sends JSON text)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"].get("arguments") or
                                                                                   "{}")
                                        if isinstance(c["function"].get("arguments"), str) else
                                        c["function"].get("arguments")}} for c in m["tool_calls"]]
            m = {**m, "content": m.get("content") or "", "tool_calls": calls}
        out.append(m)
    return out


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


def _hf_render(template: HFChatTemplate, messages: list[dict], add_generation_prompt: bool,
               tools: list[dict] | None = None) -> str:
    """A model's own template as transformers' apply_chat_template renders it (its jinja settings: sandboxed,
    trim_blocks, lstrip_blocks, `raise_exception`)."""
    import jinja2

    def raise_exception(message):
        raise ConfigError(f"the chat template refuses the conversation: {message}")

    try:
        return _hf_compiled(template.source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=template.bos_token,
            eos_token=template.eos_token, raise_exception=raise_exception, tools=tools or None)
    except jinja2.TemplateError as exc:
        raise ConfigError(f"the chat template does not render the messages ({exc.__class__.__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


@functools.lru_cache(maxsize=8)
def _hf_compiled(source: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ConfigError(f"the chat template is not valid jinja ({exc.__class__.__name__}: {exc})") from None


def _messages(system: str, turns: list[list[str]]) -> list[dict]:
    out = [{"role": "system", "content": system}] if system else []
    for turn in turns:
        out.append({"role": "user", "content": turn[0]})
        if len(turn) > 1:
            out.append({"role": "assistant", "content": turn[1]})
    return out


def render(template: dict | HFChatTemplate, system: str, turns: list[list[str]]) -> str:
    """The prompt for the last turn's answer (PaddleNLP's ChatTemplate.__call__, 2.8.1; a model's own template:
    apply_chat_template with add_generation_prompt)."""
    if isinstance(template, HFChatTemplate):
        return _hf_render(template, _messages(system, turns), add_generation_prompt=True)
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


def training_pieces(template: dict | HFChatTemplate, system: str, turns: list[list[str]]) -> list[str]:
    """An answered conversation's texts as training encodes them, each on its own (PaddleNLP's encode_chat_inputs,
    2.8.1): the system text ("" without one), then each turn's prompt and its answer. A model's own template: the
    conversation rendered as it grows, each prompt what the render gains up to the answer (with the generation
    prompt, as the server renders it), each answer what it gains with the answer (its end marker included, so the
    model learns to stop); a template that does not render a conversation as a growing text is refused."""
    if isinstance(template, HFChatTemplate):
        return _hf_pieces(template, system, turns)
    context = {"is_training": False, "system": system}
    texts = [_part(template["system"], context) if template.get("system") else ""]
    for index, (user, answer) in enumerate(turns):
        values = {"user": user, "bot": answer, "index": index, **context, "is_first": index == 0,
                  "is_last": index == len(turns) - 1}
        texts += [_part(part, values) for part in template["conversation"]]
    return texts


def _hf_pieces(template: HFChatTemplate, system: str, turns: list[list[str]]) -> list[str]:
    texts, before = [""], ""
    for index in range(len(turns)):
        asked = _messages(system, [*turns[:index], turns[index][:1]])
        prompt = _hf_render(template, asked, add_generation_prompt=True)
        answered = _hf_render(template, _messages(system, turns[:index + 1]), add_generation_prompt=False)
        if not prompt.startswith(before) or not answered.startswith(prompt) or answered == prompt:
            raise ConfigError("the chat template does not render a conversation as a growing text (each turn's "
                              "prompt, then its answer, added at the end): its answers cannot be learned")
        texts += [prompt[len(before):], answered[len(prompt):]]
        before = answered
    return texts


def render_messages(template: dict | HFChatTemplate, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt for the answer to `messages` (with `tools`, OpenAI's function definitions: a model's own template
    renders them and the tool turns itself where it names `tools`, as transformers' apply_chat_template does; this
    project's template, and one that does not, gets them as `plain_messages` writes them)."""
    if isinstance(template, HFChatTemplate) and "tools" in template.source:  # (a template that knows tools)
        return _hf_render(template, _hf_messages(messages), add_generation_prompt=True, tools=tools)
    system, turns = conversation(plain_messages(messages, tools))
    return render(template, system, turns)
