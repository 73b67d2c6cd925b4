"""The one request protocol of every entry point: Paddle Serving's Op (key/value strings), the OpenAI routes (JSON),
the MLflow pyfunc model (table rows) and the Python client all turn their wire format into the same fields and call
`parse`, so each setting and its limits are checked once, with one message, and a new parameter lands here.

    prompt          text to continue, passed through unchanged (not stripped); at most serving.max_prompt_chars
    max_new_tokens  1..serving.max_new_tokens_limit (default serving.default_max_new_tokens)
    temperature     0..10 (0 = greedy)
    top_k           0 = off, else sample among the k most likely tokens
    top_p           (0, 1]: sample among the most likely tokens whose probabilities add up to top_p (1 = off)
    seed            0..2^31-1: the sampler's seed (choice i of n uses seed + i)
    stop            up to 4 strings, each 1..32 characters: generation ends before the first one (not included)
    n               1..8 choices
    logprobs        0..5: each chosen token's log-probability and that many alternatives (None = off)
    echo            the prompt is put before the generated text
    timeout_s       the request's deadline, at most serving.request_timeout_s (the default)

Errors: one type, RequestError, whose kind maps to Paddle Serving's err_no and to an HTTP status (KINDS).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from dataclasses import replace

from core.config import ServingConfig

DEFAULTS = ServingConfig()  # (each default is written once, in core/config.py)

# kind: (err_no of Paddle Serving's answers, HTTP status of the OpenAI routes)
KINDS = {"bad_request": (8001, 400), "internal": (8002, 500), "busy": (8003, 429), "deadline": (8004, 504),
         "worker_died": (8005, 503), "unavailable": (8006, 503), "not_found": (8007, 404),
         "unauthorized": (8008, 401), "rate_limited": (8009, 429)}
# The gateway (serving/gateway/) names each request's consumer and its tokens-per-minute budget in these headers;
# nginx sets them, overwriting whatever a client sent, and the replicas listen where only the gateway reaches them
CONSUMER_HEADER, TPM_HEADER = "X-Pipeline-Consumer", "X-Pipeline-Consumer-Tpm"
# A gateway's request's `usage` for the gateway's own log (serving/gateway/usage.py: what a consumer is billed, kept
# where a replica's crash cannot lose it): "<prompt tokens> <completion tokens>" in this header of a whole answer, and
# in a stream as the SSE comment line USAGE_COMMENT (clients ignore comment lines) before `data: [DONE]`
USAGE_HEADER, USAGE_COMMENT = "X-Pipeline-Usage", ": usage"
# the model name the gateway routed a request by (gateway.models): an alias the replica itself cannot resolve
ROUTED_MODEL_HEADER = "X-Pipeline-Routed-Model"
# Each answer says which model version produced it (a canary split sends requests to replicas of two versions)
VERSION_HEADERS = ("X-Model-Name", "X-Model-Version", "X-Source-Run")
FIELDS = ("prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "n", "logprobs", "echo",
          "timeout_s")
MAX_STOP, MAX_STOP_CHARS, MAX_N, MAX_LOGPROBS = 4, 32, 8, 5


@dataclass(frozen=True)
class GenerationSettings:
    """One sequence's generation settings, as the engine (serving/engine/generation.py) samples with them."""
    max_new_tokens: int = DEFAULTS.default_max_new_tokens
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit
    seed: int = 0
    top_p: float = 1.0  # 1 = no limit: sample among the most likely tokens holding this much probability
    stop: tuple = ()  # strings that end generation (checked on the decoded text by the worker)
    logprobs: int = -1  # -1 = off; k >= 0: each chosen token's log-probability and k alternatives
    grammar: str = ""  # "" = free; else an llguidance grammar the text must follow (serving/engine/constraints.py)


class RequestError(ValueError):
    """A request that cannot be answered, with a message for the client; `kind` is one of KINDS."""

    def __init__(self, kind: str, message: str, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.kind, self.message, self.param, self.retry_after = kind, message, param, retry_after
        self.code, self.status = KINDS[kind]


@dataclass(frozen=True)
class Limits:
    max_prompt_chars: int = DEFAULTS.max_prompt_chars
    max_new_tokens_limit: int = DEFAULTS.max_new_tokens_limit
    default_max_new_tokens: int = DEFAULTS.default_max_new_tokens
    max_request_bytes: int = DEFAULTS.max_request_bytes
    request_timeout_s: float = DEFAULTS.request_timeout_s

    @classmethod
    def from_config(cls, serving_config) -> "Limits":
        s = serving_config
        return cls(s.max_prompt_chars, s.max_new_tokens_limit, s.default_max_new_tokens, s.max_request_bytes,
                   s.request_timeout_s)


@dataclass(frozen=True)
class Request:
    prompt: str
    settings: GenerationSettings
    n: int = 1
    echo: bool = False
    timeout_s: float = DEFAULTS.request_timeout_s
    stream: bool = False
    extra: dict = field(default_factory=dict)  # (route-specific, e.g. the OpenAI model name)

    def choice_settings(self, i: int) -> GenerationSettings:
        """Choice i of n: the same settings, seed + i (reproducible; greedy choices are all the same)."""
        return replace(self.settings, seed=(self.settings.seed + i) % 2**31)


def bad(message: str, param: str | None = None) -> RequestError:
    return RequestError("bad_request", message, param)


def parse(values: dict, limits: Limits) -> Request:
    """Typed values by field name (None = not given) -> a checked Request; RequestError("bad_request") otherwise."""
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise bad(f"unknown parameter(s) {', '.join(unknown)}; allowed: {', '.join(FIELDS)}", unknown[0])
    prompt = values.get("prompt")
    if prompt is None:
        raise bad("missing `prompt`: the text to continue", "prompt")
    if not isinstance(prompt, str):
        raise bad(f"`prompt` must be a string, got {type(prompt).__name__}", "prompt")
    if not prompt:
        raise bad("`prompt` is empty", "prompt")
    if len(prompt) > limits.max_prompt_chars:
        raise bad(f"`prompt` has {len(prompt)} characters; the limit is {limits.max_prompt_chars}", "prompt")
    logprobs = values.get("logprobs")
    settings = GenerationSettings(
        max_new_tokens=_number(values, "max_new_tokens", int, 1, limits.max_new_tokens_limit,
                               limits.default_max_new_tokens),
        temperature=_number(values, "temperature", float, 0.0, 10.0, 0.0),
        top_k=_number(values, "top_k", int, 0, 1_000_000, 0),
        top_p=_number(values, "top_p", float, 0.0, 1.0, 1.0, open_low=True),
        seed=_number(values, "seed", int, 0, 2**31 - 1, 0),
        stop=_stop(values.get("stop")),
        logprobs=-1 if logprobs is None else _number(values, "logprobs", int, 0, MAX_LOGPROBS, 0))
    echo = values.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad("`echo` must be true or false", "echo")
    return Request(prompt, settings, n=_number(values, "n", int, 1, MAX_N, 1), echo=bool(echo),
                   timeout_s=_number(values, "timeout_s", float, 0.0, limits.request_timeout_s,
                                     limits.request_timeout_s, open_low=True))


def _number(values: dict, name: str, kind, low, high, default, open_low: bool = False):
    value = values.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise bad(f"`{name}` must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    if not ((low < value) if open_low else (low <= value)) or not value <= high:
        raise bad(f"`{name}` must be in {'(' if open_low else '['}{low}, {high}], got {value}", name)
    return kind(value)


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP:
        raise bad(f"`stop` must be a string or a list of at most {MAX_STOP} strings", "stop")
    if not all(1 <= len(s) <= MAX_STOP_CHARS for s in stops):
        raise bad(f"`stop` strings must have 1..{MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


# -- wire formats -> typed values --------------------------------------------------------------------------------------
def from_strings(fields: dict) -> dict:
    """Paddle Serving's key/value strings (and the Python client's): numbers and booleans as text, `stop` as one
    string or a JSON list of strings."""
    out: dict = {}
    for key, raw in fields.items():
        if key not in FIELDS or key == "prompt" or raw is None:
            out[key] = raw
            continue
        if not isinstance(raw, str):
            raise bad(f"`{key}` must be sent as a string, got {type(raw).__name__}", key)
        text = raw.strip()
        if key == "stop":
            out[key] = _json_list(text) if text.startswith("[") else raw
        elif key == "echo":
            if text.lower() not in ("true", "false", "1", "0"):
                raise bad("`echo` must be true or false", "echo")
            out[key] = text.lower() in ("true", "1")
        else:
            out[key] = _text_number(key, text)
    return out


def _json_list(text: str):
    try:
        return json.loads(text)
    except ValueError:
        raise bad("`stop` must be a string or a JSON list of strings", "stop") from None


def _text_number(key: str, text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    raise bad(f"`{key}` must be a number, got {text!r}", key)


def to_strings(values: dict) -> dict[str, str]:
    """Typed values -> the key/value strings `from_strings` reads (the Python client sends these)."""
    out = {}
    for key, value in values.items():
        if value is None:
            continue
        if key == "stop" and not isinstance(value, str):
            out[key] = json.dumps(value, ensure_ascii=False)
        elif isinstance(value, bool):
            out[key] = "true" if value else "false"
        else:
            out[key] = str(value)
    return out


def check_unique_keys(keys) -> None:
    """A key sent twice is ambiguous (which value counts?): refuse it rather than silently keep one."""
    seen, repeated = set(), []
    for key in keys:
        if key in seen and key not in repeated:
            repeated.append(key)
        seen.add(key)
    if repeated:
        raise bad(f"parameter(s) sent more than once: {', '.join(map(str, repeated))}")
