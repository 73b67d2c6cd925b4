"""Client of the generation service (the paddle-serving-client role on Python 3.11): HTTP via requests, gRPC via
Paddle Serving's `PipelineClient`. Both raise `ServingError` when the server answers err_no != 0.

    python -m serving.client.client "人工智能" --max-new-tokens 16 [--grpc] [--url http://127.0.0.1:18180/generate/prediction]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from dataclasses import dataclass

import serving  # noqa: F401  (zlib first; paddle_serving_client stand-in for PipelineClient's imports)
from core.config import DEFAULT_CONFIG, load_config
from serving.protocol import Limits, RequestError, parse, to_strings
from serving.state import default_state_dir, read_state


class ServingError(RuntimeError):
    def __init__(self, err_no: int, message: str):
        super().__init__(f"err_no {err_no}: {message}")
        self.err_no, self.message = err_no, message


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: list[int]
    model_name: str
    model_version: str
    source_run_id: str
    checkpoint_step: int
    batch_size: int = 1  # the largest batch the server decoded this request in
    ttft_ms: float = 0.0  # server-side: to the first token, and per token after it
    tpot_ms: float = 0.0
    finish_reason: str = ""
    extra: dict | None = None  # choices (n > 1), logprobs: as the server sent them (JSON decoded)

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> "Generation":
        extra = {k: json.loads(fields[k]) for k in ("choices", "logprobs") if k in fields}
        return cls(text=fields["text"], token_ids=json.loads(fields["token_ids"]), model_name=fields["model_name"],
                   model_version=fields["model_version"], source_run_id=fields["source_run_id"],
                   checkpoint_step=int(fields["checkpoint_step"]), batch_size=int(fields.get("batch_size", 1)),
                   ttft_ms=float(fields.get("ttft_ms", 0)), tpot_ms=float(fields.get("tpot_ms", 0)),
                   finish_reason=fields.get("finish_reason", ""), extra=extra or None)


def _fields(**params) -> dict[str, str]:
    """The request's key/value strings, checked first by the protocol every entry point uses (serving/protocol.py:
    the same messages as the server's; the server's own limits are checked there)."""
    values = {k: v for k, v in params.items() if v is not None}
    try:
        parse(values, Limits(max_prompt_chars=1 << 20, max_new_tokens_limit=1 << 20, request_timeout_s=1e9))
    except RequestError as exc:
        raise ServingError(exc.code, exc.message) from None
    return to_strings(values)


class GenerationClient:
    def __init__(self, http_url: str, rpc_address: str | None = None, timeout: float = 60.0):
        self.http_url, self.rpc_address, self.timeout = http_url, rpc_address, timeout
        self._grpc = None

    def raw_http(self, fields: dict) -> dict:
        """POST the key/value body; returns the JSON answer whatever its err_no (for tests and debugging)."""
        import requests

        body = {"key": list(fields), "value": list(fields.values())}
        response = requests.post(self.http_url, json=body, timeout=self.timeout)
        response.raise_for_status()
        return response.json()

    def generate(self, prompt: str, max_new_tokens: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, seed: int | None = None, timeout_s: float | None = None,
                 **options) -> Generation:
        """Options: top_p, stop, n, logprobs, echo (serving/protocol.py); the answer's extra fields (choices,
        logprobs, finish_reason) are in Generation.extra."""
        answer = self.raw_http(_fields(prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                       top_k=top_k, seed=seed, timeout_s=timeout_s, **options))
        if answer.get("err_no", -1) != 0:
            raise ServingError(answer.get("err_no", -1), answer.get("err_msg", ""))
        return Generation.from_fields(dict(zip(answer["key"], answer["value"])))

    def generate_grpc(self, prompt: str, max_new_tokens: int | None = None, temperature: float | None = None,
                      top_k: int | None = None, seed: int | None = None, **options) -> Generation:
        if self._grpc is None:
            from paddle_serving_server.pipeline import PipelineClient

            self._grpc = PipelineClient()
            self._grpc.connect([self.rpc_address])
        with contextlib.redirect_stdout(io.StringIO()):  # PipelineClient prints timing lines on every call
            answer = self._grpc.predict(feed_dict=_fields(prompt=prompt, max_new_tokens=max_new_tokens,
                                                          temperature=temperature, top_k=top_k, seed=seed,
                                                          **options), fetch=None)
        if answer.err_no != 0:
            raise ServingError(answer.err_no, answer.err_msg)
        return Generation.from_fields(dict(zip(answer.key, answer.value)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--url", default=None, help="HTTP prediction URL (default: the running `make serve`)")
    parser.add_argument("--rpc", default=None, help="gRPC host:port (default: the running `make serve`)")
    parser.add_argument("--grpc", action="store_true", help="call over gRPC instead of HTTP")
    args = parser.parse_args(argv)
    url, rpc = args.url, args.rpc
    if not url or (args.grpc and not rpc):
        state = read_state(default_state_dir(load_config(DEFAULT_CONFIG)))
        if not state:
            print("error: no running server found; start one with `make serve` or pass --url/--rpc", file=sys.stderr)
            return 2
        url, rpc = url or state["http_url"], rpc or state["rpc_address"]
    client = GenerationClient(url, rpc)
    call = client.generate_grpc if args.grpc else client.generate
    try:
        result = call(args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    except ServingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result.__dict__, ensure_ascii=False, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
