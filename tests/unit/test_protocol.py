"""The one request protocol (serving/protocol.py) and its entry points: every route turns its wire format into the
same fields and refuses a bad value with the same message."""

import pandas as pd
import pytest

from serving import protocol
from serving.protocol import GenerationSettings, Limits, RequestError
from core import chat as core_chat
from serving.server.openai import api_server, wire as openai_wire, serving_chat, serving_completion

LIMITS = Limits(max_prompt_chars=10, max_new_tokens_limit=8, default_max_new_tokens=4, max_request_bytes=300,
                request_timeout_s=30.0)
MODEL_IDS = {"m", "m/1"}


def test_defaults_and_values_prompts_unchanged():
    request = protocol.parse({"prompt": "  你好  "}, LIMITS)
    assert request.prompt == "  你好  " and request.settings == GenerationSettings(max_new_tokens=4)
    assert (request.n, request.echo, request.timeout_s) == (1, False, 30.0)
    request = protocol.parse(protocol.from_strings({
        "prompt": "你好", "max_new_tokens": "8", "temperature": "0.7", "top_k": "5", "top_p": "0.9", "seed": "11",
        "stop": '["。", "！"]', "n": "3", "logprobs": "2", "echo": "true", "timeout_s": "2.5"}), LIMITS)
    assert request.settings == GenerationSettings(max_new_tokens=8, temperature=0.7, top_k=5, top_p=0.9, seed=11,
                                                   stop=("。", "！"), logprobs=2)
    assert (request.n, request.echo, request.timeout_s) == (3, True, 2.5)
    assert [request.choice_settings(i).seed for i in range(3)] == [11, 12, 13]
    assert protocol.parse(protocol.from_strings({"prompt": "x", "stop": "。"}), LIMITS).settings.stop == ("。",)
    assert protocol.from_strings(protocol.to_strings({"prompt": "x", "stop": ["a", "b"], "echo": True, "n": 2})) == \
        {"prompt": "x", "stop": ["a", "b"], "echo": True, "n": 2}


# (typed values, the message every entry point gives, whether it depends on the server's own limits)
BAD = [
    ({}, "missing `prompt`", False),
    ({"prompt": ""}, "`prompt` is empty", False),
    ({"prompt": "很" * 11}, "`prompt` has 11 characters; the limit is 10", True),
    ({"prompt": "x", "max_new_tokens": 9}, r"`max_new_tokens` must be in \[1, 8\], got 9", True),
    ({"prompt": "x", "temperature": -1}, r"`temperature` must be in \[0.0, 10.0\], got -1", False),
    ({"prompt": "x", "top_p": 0}, r"`top_p` must be in \(0.0, 1.0\], got 0", False),
    ({"prompt": "x", "top_p": 1.5}, r"`top_p` must be in \(0.0, 1.0\], got 1.5", False),
    ({"prompt": "x", "seed": 1.5}, "`seed` must be an integer, got 1.5", False),
    ({"prompt": "x", "n": 9}, r"`n` must be in \[1, 8\], got 9", False),
    ({"prompt": "x", "logprobs": 6}, r"`logprobs` must be in \[0, 5\], got 6", False),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "`stop` must be a string or a list of at most 4 strings",
     False),
    ({"prompt": "x", "stop": [""]}, "`stop` strings must have 1..32 characters", False),
]


@pytest.mark.parametrize("values, message, server_limit", BAD)
def test_every_entry_point_refuses_the_same_values_with_the_same_message(values, message, server_limit):
    from serving.client import client
    from serving.offline import pyfunc
    from serving.server.paddle_serving_op import parse_fields

    with pytest.raises(RequestError, match=message) as direct:
        protocol.parse(values, LIMITS)
    assert direct.value.kind == "bad_request" and (direct.value.code, direct.value.status) == (8001, 400)
    # Paddle Serving's key/value strings (what the Python client and curl send)
    with pytest.raises(RequestError, match=message):
        parse_fields(protocol.to_strings(values), LIMITS)
    # the OpenAI completions route (OpenAI's own name: max_tokens)
    body = {"model": "m", **{("max_tokens" if k == "max_new_tokens" else k): v for k, v in values.items()}}
    with pytest.raises(RequestError, match=message.replace("max_new_tokens", "max_tokens")):
        serving_completion.parse_completion(body, LIMITS, MODEL_IDS)
    if server_limit:
        return  # (the pyfunc model's limits are the model's own; the client leaves limits to the server)
    # the Python client checks before sending (err_no as the server would answer)
    with pytest.raises(client.ServingError, match=message) as sent:
        client._fields(**values)
    assert sent.value.err_no == 8001
    # the MLflow pyfunc model: a DataFrame row (its row number first), for the options it takes
    if set(values) <= {"prompt", *pyfunc.OPTIONAL_INPUTS}:
        row = pyfunc._rows(pd.DataFrame([values]) if values else pd.DataFrame({"seed": [1]}))[0]
        with pytest.raises(RequestError, match="row 0: " + message):
            pyfunc._parse(0, row, max_length=8)


@pytest.mark.parametrize("fields, message", [
    ({"prompt": "x", "max_new_tokens": 3}, "`max_new_tokens` must be sent as a string"),
    ({"prompt": "x", "seed": "a"}, "`seed` must be a number, got 'a'"),
    ({"prompt": "x", "echo": "maybe"}, "`echo` must be true or false"),
    ({"prompt": "x", "beam": "2", "alpha": "1"}, r"unknown parameter\(s\) alpha, beam"),
    ({"prompt": "x" * 300}, "request is 30[0-9] bytes; the limit is 300"),
])
def test_key_value_requests(fields, message):
    from serving.server.paddle_serving_op import parse_fields

    with pytest.raises(RequestError, match=message):
        parse_fields(fields, LIMITS)


def test_repeated_request_keys_are_refused():
    protocol.check_unique_keys(["prompt", "max_new_tokens"])
    with pytest.raises(RequestError, match=r"sent more than once: prompt$"):
        protocol.check_unique_keys(["prompt", "seed", "prompt", "prompt"])


def test_openai_requests():
    """OpenAI's names and defaults (temperature 1), chat rendering with the template, stream options, and
    OpenAI-shaped refusals."""
    request = serving_completion.parse_completion({"model": "m/1", "prompt": ["你好"], "max_tokens": 3, "stop": "。",
                                    "stream": True, "stream_options": {"include_usage": True}}, LIMITS, MODEL_IDS)
    assert (request.prompt, request.settings.max_new_tokens, request.settings.temperature) == ("你好", 3, 1.0)
    assert request.stream and request.extra == {"model": "m/1", "include_usage": True, "tool_calls": False}
    assert request.settings.stop == ("。",)
    chat = serving_chat.parse_chat({"model": "m", "messages": [{"role": "user", "content": "你好"}], "logprobs": True,
                           "top_logprobs": 2, "temperature": 0}, Limits(max_prompt_chars=100), MODEL_IDS,
                          core_chat.TEMPLATE)
    assert chat.prompt == "用户：你好\n助手：" and chat.settings.logprobs == 2
    assert chat.settings.temperature == 0.0
    streamed = serving_completion.parse_completion({"model": "m", "prompt": "a", "logprobs": 1, "stream": True}, LIMITS,
                                                   MODEL_IDS)  # (logprobs stream, as OpenAI's and vLLM's)
    assert streamed.stream and streamed.settings.logprobs == 1
    for body, message, status in [
        ({"model": "x", "prompt": "a"}, "The model `x` does not exist", 404),
        ({"model": "m", "prompt": "a", "suffix": "b"}, "`suffix` is not supported", 400),
        ({"model": "m", "prompt": "a", "stream": "yes"}, "`stream` must be true or false", 400),
        ({"model": "m", "prompt": ["a", "b"]}, "`prompt` must be one string", 400),
        ([1, 2], "the request body must be a JSON object", 400),
    ]:
        with pytest.raises(RequestError, match=message) as exc:
            serving_completion.parse_completion(body, LIMITS, MODEL_IDS)
        assert exc.value.status == status
    with pytest.raises(RequestError, match="`messages` must be a non-empty list"):
        serving_chat.parse_chat({"model": "m", "messages": []}, LIMITS, MODEL_IDS, core_chat.TEMPLATE)
    status, body = openai_wire.error_body(RequestError("busy", "server busy"))
    assert status == 429 and body["error"]["code"] == "busy"


def test_the_chat_route_uses_the_exports_template_and_refuses_without_one(tmp_path):
    """A fine-tuned export's tokenizer/chat_template.json renders the messages; a base model (none) gets a 400 that
    says so; a conversation that does not end with a question is a 400 too."""
    (tmp_path / "tokenizer").mkdir()
    assert serving_chat.chat_template(tmp_path) is None
    user = {"model": "m", "messages": [{"role": "user", "content": "嗨"}]}
    with pytest.raises(RequestError, match="this model has no chat template") as exc:
        serving_chat.parse_chat(user, LIMITS, MODEL_IDS, None)
    assert exc.value.status == 400
    core_chat.write(tmp_path / "tokenizer", {"system": None, "conversation": ["<u>{{ user }}", "<a>{{ bot }}"],
                                             "query": "<u>{{ query }}<a>"})
    template = serving_chat.chat_template(tmp_path)
    messages = [{"role": "user", "content": "一"}, {"role": "assistant", "content": "二"},
                {"role": "user", "content": "三"}]
    assert serving_chat.parse_chat({**user, "messages": messages}, Limits(max_prompt_chars=100), MODEL_IDS,
                                   template).prompt == \
        "<u>一<a>二<u>三<a>"
    with pytest.raises(RequestError, match="must end with a user message") as exc:
        serving_chat.parse_chat({**user, "messages": messages[:2]}, LIMITS, MODEL_IDS, template)
    assert exc.value.status == 400


def test_chat_requests_out_of_shape_get_a_400_naming_the_message():
    """A conversation as a chat UI sends it passes; an unknown role, empty content, roles out of order or a
    conversation longer than serving.max_prompt_chars each get a 400 that names the fault (nothing is cut)."""
    def ask(*messages, limit=200):
        return serving_chat.parse_chat({"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]},
                                       Limits(max_prompt_chars=limit), MODEL_IDS, core_chat.TEMPLATE)

    good = [("system", "你是助手"), ("user", "你好"), ("assistant", "你好！"), ("user", "评论：很好")]
    assert ask(*good).prompt == "你是助手\n用户：你好\n助手：你好！[SEP]用户：评论：很好\n助手："
    for messages, message in [
        ([("user", "一"), ("critic", "二")], r"messages\[1\]: unknown role 'critic'"),
        ([("user", " ")], r"messages\[0\]: empty user content"),
        ([("system", "s"), ("user", "一"), ("assistant", "")], r"messages\[2\]: empty assistant content"),
        ([("user", "一"), ("user", "二")], r"messages\[1\]: role 'user' after 'user'"),
        ([("assistant", "一"), ("user", "二")], r"messages\[0\]: role 'assistant' after 'system'"),
        ([("user", "一"), ("assistant", "二"), ("assistant", "三"), ("user", "四")],
         r"messages\[2\]: role 'assistant' after 'assistant'"),
        ([("user", "一"), ("system", "二"), ("user", "三")], r"messages\[1\]: role 'system' after 'user'"),
        ([("user", "一"), ("assistant", "二")], "must end with a user message"),
    ]:
        with pytest.raises(RequestError, match=message) as exc:
            ask(*messages)
        assert exc.value.status == 400 and exc.value.param == "messages"
    length = len(ask(*good).prompt)
    assert ask(*good, limit=length).prompt
    with pytest.raises(RequestError, match=f"the conversation is {length} characters with the chat template; the "
                                           f"limit is serving.max_prompt_chars={length - 1}") as exc:
        ask(*good, limit=length - 1)
    assert exc.value.status == 400


class IdleDispatcher:
    fatal, draining, ready, in_flight = "", False, True, 0
    meta = {"registered_model_name": "m", "version": 1, "source_run_id": "r"}


def test_the_api_key_guards_the_v1_routes_and_not_the_probes(monkeypatch):
    from fastapi.testclient import TestClient

    monkeypatch.delenv("PIPELINE_API_KEY", raising=False)
    open_app = TestClient(api_server.ApiServer(IdleDispatcher(), LIMITS).app())
    assert open_app.get("/v1/models").status_code == 200
    guarded = TestClient(api_server.ApiServer(IdleDispatcher(), LIMITS, api_key="s3cret").app())
    refused = guarded.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
    assert guarded.get("/v1/models").status_code == 401
    assert guarded.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert guarded.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).json()["data"][0]["id"] == "m"
    assert guarded.get("/health/live").status_code == 200 and guarded.get("/health/ready").status_code == 200
    monkeypatch.setenv("PIPELINE_API_KEY", "from-env")
    env_keyed = TestClient(api_server.ApiServer(IdleDispatcher(), LIMITS).app())
    assert env_keyed.get("/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200
    assert env_keyed.get("/v1/models").status_code == 401
    assert guarded.post("/admin/reload").status_code == 401
    reload = guarded.post("/admin/reload", headers={"Authorization": "Bearer s3cret"})
    assert reload.status_code == 400 and "fixed export directory" in reload.json()["error"]["message"]
    assert guarded.get("/nope").status_code == 404 and guarded.get("/nope").json()["error"]["code"] == "not_found"


def test_parse_completion_maps_every_openai_option_onto_the_protocol():
    request = serving_completion.parse_completion({"model": "m", "prompt": "你好", "max_completion_tokens": 5, "n": 3, "echo": True,
                                    "top_p": 0.5, "seed": 11, "logprobs": 2, "temperature": 0.3,
                                    "stop": ["。", "！"], "user": "ignored"}, LIMITS, MODEL_IDS)
    s = request.settings
    assert (request.n, request.echo, s.max_new_tokens, s.top_p, s.seed, s.logprobs, s.temperature, s.stop) == \
        (3, True, 5, 0.5, 11, 2, 0.3, ("。", "！"))
    assert [request.choice_settings(i).seed for i in range(3)] == [11, 12, 13]
    defaults = serving_completion.parse_completion({"model": "m", "prompt": "a"}, LIMITS, MODEL_IDS)
    assert (defaults.n, defaults.settings.temperature, defaults.settings.logprobs, defaults.stream) == (1, 1.0, -1,
                                                                                                         False)
    with pytest.raises(RequestError, match="`n` must be in"):
        serving_completion.parse_completion({"model": "m", "prompt": "a", "n": 9}, LIMITS, MODEL_IDS)
