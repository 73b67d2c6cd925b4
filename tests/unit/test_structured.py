"""Structured output and tool calls as logic (fast): OpenAI's `response_format` / `tools` / `tool_choice` -> the
grammar (serving/server/openai/structured.py), checked against a character vocabulary like the default one (no upper
case, no whitespace); the scheduler decoding constrained and free rows in one batch on a model of random logits
(serving/engine/constraints.py); tool calls read back and streamed; tools and tool turns in the chat template.
(Served, with the openai client and LangChain: tests/integration/test_serving.py, test_finetune.py.)"""
import json
import string

import jsonschema
import numpy as np
import pytest
import test_generation
from test_generation import ScriptedCache

from bench.constrained import SCHEMAS, strict
from core import chat
from core.tokenizer import SPECIAL_TOKENS, write_tokenizer
from serving.engine.constraints import Grammars, Vocabulary
from serving.engine.scheduler import Job, Scheduler
from serving.protocol import GenerationSettings, RequestError
from serving.server.openai import structured
from serving.server.openai.streaming import CallStream

CHARS = string.digits + string.ascii_lowercase + "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~" + "正面负面好不天气北京上海晴雨"
SCHEMAS = [strict(s) for s in SCHEMAS]  # (bench/constrained.py's ten, strict as LangChain sends them)


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    write_tokenizer(SPECIAL_TOKENS + list(CHARS) + ["##" + c for c in string.digits], root)
    return Vocabulary(root, SPECIAL_TOKENS.index("[SEP]"))


def _structure(vocabulary, chat_route=True, **body):
    return structured.structure({"model": "m", **body}, chat_route, vocabulary)


def _schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 3}}, "required": ["city"],
                                               "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}}]


def test_bad_schemas_literals_and_tool_choices_are_refused_naming_the_problem(vocabulary, tmp_path):
    cases = [
        (dict(response_format=_schema_format({"type": "objekt"})), "not a valid JSON schema"),
        (dict(response_format=_schema_format({"type": "object", "properties": {"Label": {"type": "string"}}})),
         "the property name 'Label' in `response_format` cannot be generated: this model's vocabulary has no 'L'"),
        (dict(response_format=_schema_format({"enum": ["very good"]})), "has no ' '"),
        (dict(response_format={"type": "yaml"}), "one of text, json_object, json_schema"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "`tool_choice` names 'nope', which is not in `tools` (get_weather, add)"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
         "`parameters` must be a JSON schema of type object"),
        (dict(tools=[{"type": "function", "function": {"name": "GetWeather"}}], tool_choice="required"),
         "the tool name 'GetWeather' cannot be generated"),
        (dict(tools=TOOLS + TOOLS[:1]), "the name 'get_weather' is given twice"),
        (dict(tool_choice="required"), "`tool_choice` 'required' needs `tools`"),
    ]
    for body, message in cases:
        with pytest.raises(RequestError, match=__import__("re").escape(message)) as caught:
            _structure(vocabulary, **body)
        assert caught.value.status == 400
    write_tokenizer([t for t in SPECIAL_TOKENS + list(CHARS) if t not in "{}"], tmp_path)  # (no { and })
    braceless = Vocabulary(tmp_path, vocabulary.eos_id)
    with pytest.raises(RequestError, match=r"JSON's syntax for `response_format` cannot be generated: .* no '\{' '\}'"):
        _structure(braceless, response_format={"type": "json_object"})
    with pytest.raises(RequestError, match="`tools` is a chat option"):
        _structure(vocabulary, chat_route=False, tools=TOOLS)
    # text, tools without a call, and no tools: no grammar
    assert _structure(vocabulary, response_format={"type": "text"}) == structured.Structure()
    assert _structure(vocabulary) == structured.Structure()
    none = _structure(vocabulary, tools=TOOLS, tool_choice="none")  # (text: never a call)
    assert none.tools == tuple(TOOLS) and none.grammar and not none.calls


def _random_model(monkeypatch, vocab_size: int, prefer: dict[int, float] | None = None):
    """The hand-made cache model of test_generation with each history's logits drawn at random (seeded by it)."""
    def history_logits(history):
        rng = np.random.default_rng(abs(hash(tuple(history))) % 2**32)
        logits = rng.normal(size=vocab_size).astype("float32") * 3
        for token, bias in (prefer or {}).items():
            logits[token] += bias
        return logits
    monkeypatch.setattr(test_generation, "history_logits", history_logits)
    return ScriptedCache()


def _decode(vocabulary, ids):
    return "".join(vocabulary.pieces[i] for i in ids if i != vocabulary.eos_id)


def test_constrained_rows_follow_their_schemas_beside_free_rows_that_are_untouched(vocabulary, monkeypatch):
    """10 schemas x 10 rows (greedy and sampled) in one batch with free rows: every constrained answer parses and
    validates; the free rows' tokens are the same as in a batch without constrained rows; the masks filled ahead
    (on a thread, during the decode step) or in the choose step give the same answers."""
    size, eos = len(vocabulary.pieces), vocabulary.eos_id
    model = _random_model(monkeypatch, size, prefer={eos: 2.0})
    grammars = Grammars(vocabulary.table)

    def run(constrained: bool, overlap: bool = True):
        s = Scheduler(model.prefill, model.decode, eos, [0, 1, 2, 4], usable_vocab=size, max_length=160,
                      max_batch_size=120, overlap_masks=overlap)
        free = [Job(1000 + i, [7 + i, 9], GenerationSettings(max_new_tokens=12, temperature=i % 2, seed=i))
                for i in range(8)]
        jobs = [] if not constrained else [
            Job(k * 10 + i, [8 + i], GenerationSettings(max_new_tokens=120, temperature=(i % 3) * 0.7, seed=i,
                                                        grammar=structured.json_grammar(schema)),
                constraint=grammars.constraint(structured.json_grammar(schema)))
            for k, schema in enumerate(SCHEMAS) for i in range(10)]
        for job in free + jobs:
            s.add(job)
        done = {}
        while not s.idle:
            for outcome in s.step():
                done[outcome.job.id] = (outcome.status, list(outcome.job.new))
        return done

    alone, mixed = run(False), run(True)
    assert {i: mixed[i] for i in alone} == alone
    assert run(True, overlap=False) == mixed  # (masks filled during the decode step: the same answers)
    for k, schema in enumerate(SCHEMAS):
        texts = [_decode(vocabulary, mixed[k * 10 + i][1]) for i in range(10)]
        assert all(mixed[k * 10 + i][0] == "done" and mixed[k * 10 + i][1][-1] == eos for i in range(10)), texts
        for text in texts:
            jsonschema.validate(json.loads(text), schema)
        assert len(set(texts)) > 1 or k == 7, texts  # (seeded samples differ: the mask does not fix the answer)


def test_a_constraint_that_cannot_go_on_ends_its_row_only(vocabulary, monkeypatch):
    """A grammar that needs a character the vocabulary lacks (here a forced "A" got past the server's check):
    that request ends with an error at the step it is stuck; its neighbour finishes as alone."""
    size, eos = len(vocabulary.pieces), vocabulary.eos_id
    model = _random_model(monkeypatch, size)
    grammars = Grammars(vocabulary.table)
    stuck = structured.json_grammar({"const": "abA"})
    s = Scheduler(model.prefill, model.decode, eos, [0, 1, 2, 4], usable_vocab=size, max_length=64)
    s.add(Job(1, [9], GenerationSettings(max_new_tokens=10, grammar=stuck), constraint=grammars.constraint(stuck)))
    s.add(Job(2, [9], GenerationSettings(max_new_tokens=10)))
    done = {}
    while not s.idle:
        done.update({o.job.id: o for o in s.step()})
    assert done[1].status == "error" and "allows no token" in done[1].job.error
    assert _decode(vocabulary, done[1].job.new) == "\"ab"
    assert done[2].status == "done" and len(done[2].job.new) == 10


def test_tool_choices_make_grammars_whose_answers_read_back_as_calls(vocabulary, monkeypatch):
    size, eos = len(vocabulary.pieces), vocabulary.eos_id
    model = _random_model(monkeypatch, size, prefer={eos: 2.0})
    grammars = Grammars(vocabulary.table)

    def answers(structure, n=12):
        s = Scheduler(model.prefill, model.decode, eos, [0, 1, 2, 4], usable_vocab=size, max_length=200,
                      max_batch_size=n)
        for i in range(n):
            s.add(Job(i, [9, i + 5], GenerationSettings(max_new_tokens=150, temperature=1.0, seed=i),
                      constraint=grammars.constraint(structure.grammar)))
        done = {}
        while not s.idle:
            done.update({o.job.id: _decode(vocabulary, o.job.new) for o in s.step()})
        return [done[i] for i in range(n)]

    named = _structure(vocabulary, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                       parallel_tool_calls=False)
    for text in answers(named):
        (call,) = structured.tool_calls(text)
        assert call["function"]["name"] == "add" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), TOOLS[1]["function"]["parameters"])
    required = [structured.tool_calls(t) for t in answers(_structure(vocabulary, tools=TOOLS,
                                                                     tool_choice="required"))]
    assert all(calls for calls in required) and {c["function"]["name"] for cs in required for c in cs} == \
        {"get_weather", "add"}
    auto = answers(_structure(vocabulary, tools=TOOLS), n=24)
    kinds = {structured.tool_calls(t) is None for t in auto}
    assert kinds == {True, False}, auto  # (text and calls both: the model chooses)
    assert all(t and not t.startswith("<") for t in auto if structured.tool_calls(t) is None)


def test_tool_calls_stream_name_first_then_arguments_and_text_as_it_comes():
    text = chat.tool_call_text("add", {"a": 1, "b": 2}) + chat.tool_call_text("get_weather", '{"city": "北京"}')
    stream, deltas = CallStream(), []
    for i in range(0, len(text), 7):
        deltas += stream.feed(text[i:i + 7])
    deltas += stream.feed("", final=True)
    assert [list(d["tool_calls"][0]) for d in deltas] == [["index", "id", "type", "function"], ["index", "function"]] * 2
    assert [d["tool_calls"][0]["function"].get("name") for d in deltas] == ["add", None, "get_weather", None]
    assert [json.loads(d["tool_calls"][0]["function"]["arguments"]) for d in deltas[1::2]] == \
        [{"a": 1, "b": 2}, {"city": "北京"}]
    words, plain = CallStream(), []
    for piece in ["正面", "，好", ""]:
        plain += words.feed(piece, final=not piece)
    assert plain == [{"content": "正面"}, {"content": "，好"}] and words.count == 0
    assert structured.tool_calls(chat.TOOL_OPEN + '{"name":"add","argu') is None  # (cut short: text)


def test_the_agent_loop_renders_with_tools_and_bad_turns_are_refused():
    loop = [{"role": "system", "content": "简短"}, {"role": "user", "content": "北京天气？"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "北京"}'}}]},
            {"role": "tool", "content": "晴", "tool_call_id": "c1"}]
    chat.check_request(loop)
    prompt = chat.render_messages(chat.TEMPLATE, loop, TOOLS[:1])
    listed = json.dumps([TOOLS[0]["function"]], ensure_ascii=False, separators=(",", ":"))
    assert prompt == ("简短\n" + chat.TOOLS_HEADER + listed + "\n用户：北京天气？\n助手：<tool_call>"
                      '{"name":"get_weather","arguments":{"city":"北京"}}</tool_call>[SEP]用户：工具结果：晴\n助手：')
    # a model's own template that names tools gets them and the tool turns as transformers passes them
    seen = chat.HFChatTemplate("{{ tools[0].function.name }}|{% for m in messages %}{{ m.role }}:"
                               "{{ m.tool_calls[0].function.arguments.city if m.tool_calls else m.content }};"
                               "{% endfor %}")
    assert chat.render_messages(seen, loop, TOOLS[:1]) == "get_weather|system:简短;user:北京天气？;assistant:北京;tool:晴;"
    for bad, fault in [(loop[:3], "must end with a user message"),
                       (loop[:2] + [loop[3]], "role 'tool' after 'user'"),
                       (loop[:3] + [loop[1]], "role 'user' after 'calls'")]:
        with pytest.raises(chat.ConfigError, match=fault):
            chat.check_request(bad)
