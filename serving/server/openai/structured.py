"""OpenAI's structured output and tool calls: `response_format` (json_object, json_schema) and `tools` /
`tool_choice` / `parallel_tool_calls` -> the grammar the engine decodes under (serving/engine/constraints.py),
checked here before dispatch; a tool-calling answer's text -> OpenAI's `tool_calls`.

A tool call is written `<tool_call>{"name":...,"arguments":{...}}</tool_call>` (core/chat.py: Qwen2's and Hermes'
markers), calls one after another when `parallel_tool_calls` (OpenAI's default) allows several. `tool_choice`:
"none" (text that does not begin with "<": the tools are still in the prompt, and a model trained with them would
write a call), "auto" (the default with tools: text that does not begin with "<",
or calls), "required" (one or more calls), {"type": "function", "function": {"name"}} (a call of that one). JSON is
generated compact (no whitespace between tokens: the default vocabulary has none); a literal the vocabulary cannot
write (a property name, an enum value, a tool's name) is refused with the characters it lacks.
"""
from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass

import jsonschema
import llguidance

from core.chat import TOOL_CLOSE, TOOL_OPEN
from serving.protocol import bad
from serving.engine.constraints import check_grammar, unproducible

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
TEXT = r"/[^<](.|\n)*/"  # (auto: an answer in text does not begin with a tool call's "<")


@dataclass(frozen=True)
class Structure:
    grammar: str = ""  # "" = free text
    tools: tuple = ()  # the request's tools (rendered into the prompt by the chat template)
    calls: bool = False  # the answer may be tool calls: its text is read back as `tool_calls`


FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls")


def structure(body: dict, chat: bool, vocabulary) -> Structure:
    """The request's grammar and tools, or RequestError naming the problem. `vocabulary`: the served model's
    (serving/engine/constraints.py Vocabulary), or None when it has none to check against. Cached by those fields'
    JSON: an app sends the same schema again and again, and its checks cost ~1.2 ms (measured) on the event loop."""
    try:
        # (not sort_keys: the tools come back from the key as the client ordered them, and the chat template
        # renders them in that order -- sorted, a tool-trained model saw definitions it never trained on)
        key = json.dumps([body.get(k) for k in FIELDS], ensure_ascii=False)
    except (TypeError, ValueError):
        raise bad("`response_format` and `tools` must be JSON") from None
    return _structure(key, chat, vocabulary)


@functools.lru_cache(maxsize=256)
def _structure(key: str, chat: bool, vocabulary) -> Structure:
    body = dict(zip(FIELDS, json.loads(key)))
    schema = _response_schema(body.get("response_format"))
    tools = _tools(body.get("tools")) if chat else ()
    if not chat and body.get("tools"):
        raise bad("`tools` is a chat option (/v1/chat/completions)", "tools")
    choice = _choice(body.get("tool_choice"), tools)
    parallel = True if body.get("parallel_tool_calls") is None else body["parallel_tool_calls"]
    if not isinstance(parallel, bool):
        raise bad("`parallel_tool_calls` must be true or false", "parallel_tool_calls")
    if schema is None and choice == "none" and not tools:
        return Structure()
    if vocabulary is None:
        raise bad("this model's export has no tokenizer to constrain generation with", "response_format")
    for where, item in [("response_format", schema)] + [(f"tools[{i}]", t["function"].get("parameters"))
                                                        for i, t in enumerate(tools)]:
        _check_schema(item, where, vocabulary)
    if choice == "none":  # (text, or the schema's JSON: never a call, which a tool-trained model would write)
        grammar = json_grammar(schema) if schema is not None else _grammar_from_lark(
            f"%llguidance {{}}\nstart: text\ntext: {TEXT}")
        return Structure(_compiled(grammar, vocabulary), tools)
    called = [t for t in tools if choice in ("auto", "required") or t["function"]["name"] == choice]
    _check_literal(TOOL_OPEN + TOOL_CLOSE + '{"name":"","arguments":}', "the tool call's syntax", vocabulary)
    for t in called:
        _check_literal(t["function"]["name"], f"the tool name {t['function']['name']!r}", vocabulary)
    answer = f"%json {json.dumps(_compact(schema))}" if schema is not None else TEXT
    lark = "\n".join(["%llguidance {}", "start: calls" + (" | text" if choice == "auto" else ""),
                      "calls: call" + ("+" if parallel else ""), f"call: {json.dumps(TOOL_OPEN)} body "
                      f"{json.dumps(TOOL_CLOSE)}", f"body: %json {json.dumps(_compact(_call_schema(called)))}",
                      f"text: {answer}" if choice == "auto" else ""])
    return Structure(_compiled(_grammar_from_lark(lark), vocabulary), tools, calls=True)


def json_grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def _compact(schema: dict) -> dict:
    """A schema for a Lark grammar's %json, generated compact as json_grammar's (llguidance reads "x-guidance")."""
    return {**schema, "x-guidance": JSON_OPTIONS}


def _grammar_from_lark(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _compiled(grammar: str, vocabulary) -> str:
    problem = check_grammar(grammar, vocabulary.table)
    if problem:
        raise bad(f"the schema cannot be used for constrained decoding: {problem.splitlines()[0]}", "response_format")
    return grammar


def _response_schema(value) -> dict | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad("`response_format.json_schema` must be {\"name\", \"schema\": {...}, \"strict\"}",
                      "response_format")
        return spec.get("schema") or {"type": "object"}
    raise bad(f"`response_format.type` {kind!r}: one of text, json_object, json_schema", "response_format")


def _tools(value) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad("`tools` must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    seen = set()
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad(f"`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{\"name\", \"description\", "
                      f"\"parameters\"}}}}", "tools")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise bad(f"`tools[{i}]` ({function['name']}): `parameters` must be a JSON schema of type object",
                      "tools")
        if function["name"] in seen:
            raise bad(f"`tools`: the name {function['name']!r} is given twice", "tools")
        seen.add(function["name"])
    return tuple(value)


def _choice(value, tools: tuple) -> str:
    names = [t["function"]["name"] for t in tools]
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        value = value["function"].get("name")
        if value not in names:
            raise bad(f"`tool_choice` names {value!r}, which is not in `tools` ({', '.join(names) or 'none'})",
                      "tool_choice")
        return value
    if value not in ("none", "auto", "required"):
        raise bad("`tool_choice` must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\"}}",
                  "tool_choice")
    if value != "none" and not tools:
        raise bad(f"`tool_choice` {value!r} needs `tools`", "tool_choice")
    return value


def _call_schema(tools: list[dict]) -> dict:
    options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                 "arguments": t["function"].get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _check_schema(schema, where: str, vocabulary) -> None:
    """A JSON schema the validator accepts, whose literals (property names, enum and const strings) the vocabulary
    can write."""
    if schema is None:
        return

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path)
        raise bad(f"`{where}`: not a valid JSON schema{' at ' + path if path else ''}: {exc.message}",
                  "response_format" if where == "response_format" else "tools") from None
    for text, what in _literals(schema):
        _check_literal(text, f"{what} {text!r} in `{where}`", vocabulary)
    written = json.dumps(schema)
    syntax = "".join(chars for kind, chars in (("object", '{}":,'), ("array", "[],"), ("string", '"'))
                     if f'"{kind}"' in written)
    _check_literal(syntax, f"JSON's syntax for `{where}`", vocabulary)


def _literals(schema):
    """(text, what) of every literal a schema makes the model write."""
    if isinstance(schema, list):
        for item in schema:
            yield from _literals(item)
        return
    if not isinstance(schema, dict):
        return
    for name in schema.get("properties", {}) if isinstance(schema.get("properties"), dict) else ():
        yield name, "the property name"
    for value in (schema.get("enum") or []) + ([schema["const"]] if "const" in schema else []):
        if isinstance(value, str):
            yield value, "the value"
    for key, value in schema.items():
        if key not in ("enum", "const", "description", "title", "default", "examples"):
            yield from _literals(value if key != "properties" else list(value.values()) if isinstance(value, dict)
                                 else value)


def _check_literal(text: str, what: str, vocabulary) -> None:
    missing = unproducible(text, vocabulary.chars)
    if missing:
        raise bad(f"{what} cannot be generated: this model's vocabulary has no {' '.join(repr(c) for c in missing)} "
                  "(the default character vocabulary has no upper case and no whitespace)",
                  "tools" if what.startswith("the tool") or "`tools[" in what else "response_format")


# -- the answer ---------------------------------------------------------------------------------------------------
def tool_calls(text: str) -> list[dict] | None:
    """A generated answer's tool calls in OpenAI's shape (None: the answer is text). Calls cut short (the answer
    ran out of tokens) are not calls: None."""
    if not text.startswith(TOOL_OPEN):
        return None
    calls, rest = [], text
    while rest.startswith(TOOL_OPEN) and TOOL_CLOSE in rest:
        body, rest = rest[len(TOOL_OPEN):].split(TOOL_CLOSE, 1)
        try:
            call = json.loads(body)
        except ValueError:
            return None
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": json.dumps(call["arguments"], ensure_ascii=False)}})
    return calls or None
