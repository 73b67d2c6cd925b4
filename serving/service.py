"""The Paddle Serving Pipeline service: text generation with an exported model.

Request  (HTTP `POST /<service>/prediction`, or gRPC PipelineClient): key/value lists of strings,
    prompt (required), max_new_tokens, temperature (0 = greedy, the default), top_k (0 = off), seed
Response: err_no 0 and key/value lists: text, token_ids (JSON list), model_name, model_version, source_run_id,
    checkpoint_step, batch_size (how many requests were generated together with this one). A bad request gets err_no != 0 with a message saying what was wrong; the server stays up.

Run by `pipeline serve` as `python -m serving.service --config <rendered config.yml> --model <export dir>`.
"""
from __future__ import annotations

import argparse
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import serving  # noqa: F401  (zlib first; paddle_serving_client stand-in)
from serving.generation import GenerationSettings
from serving.model import ExportedModel, RequestError

# Application error codes, returned as err_no (Paddle Serving's own codes are below 1000 or negative).
BAD_REQUEST = 8001
INTERNAL_ERROR = 8002
FIELDS = ("prompt", "max_new_tokens", "temperature", "top_k", "seed")


@dataclass(frozen=True)
class Limits:
    max_prompt_chars: int
    max_new_tokens_limit: int
    default_max_new_tokens: int
    max_request_bytes: int

    @classmethod
    def from_config(cls, serving_config) -> "Limits":
        return cls(serving_config.max_prompt_chars, serving_config.max_new_tokens_limit,
                   serving_config.default_max_new_tokens, serving_config.max_request_bytes)


def _number(name: str, raw, kind, low, high):
    if not isinstance(raw, str):
        raise RequestError(f"{name} must be sent as a string, got {type(raw).__name__}")
    try:
        value = kind(raw.strip())
    except ValueError:
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from None
    if not low <= value <= high:
        raise RequestError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def check_unique_keys(keys) -> None:
    """A key sent twice is ambiguous (which value counts?): refuse it rather than silently keep one."""
    seen, repeated = set(), []
    for key in keys:
        if key in seen and key not in repeated:
            repeated.append(key)
        seen.add(key)
    if repeated:
        raise RequestError(f"parameter(s) sent more than once: {', '.join(map(str, repeated))}")


def parse_request(fields: dict, limits: Limits) -> tuple[str, GenerationSettings]:
    """Validate one request's key/value fields; every problem raises RequestError with a message for the client."""
    size = sum(len(str(k).encode()) + len(str(v).encode()) for k, v in fields.items())
    if size > limits.max_request_bytes:
        raise RequestError(f"request is {size} bytes; the limit is {limits.max_request_bytes}")
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise RequestError(f"unknown parameter(s) {', '.join(unknown)}; allowed: {', '.join(FIELDS)}")
    if "prompt" not in fields:
        raise RequestError("missing prompt: send key 'prompt' with the text to continue")
    prompt = fields["prompt"]
    if not isinstance(prompt, str):
        raise RequestError(f"prompt must be a string, got {type(prompt).__name__}")
    prompt = prompt.strip()
    if not prompt:
        raise RequestError("prompt is empty")
    if len(prompt) > limits.max_prompt_chars:
        raise RequestError(f"prompt has {len(prompt)} characters; the limit is {limits.max_prompt_chars}")
    settings = GenerationSettings(
        max_new_tokens=_number("max_new_tokens", fields.get("max_new_tokens", str(limits.default_max_new_tokens)), int,
                               1, limits.max_new_tokens_limit),
        temperature=_number("temperature", fields.get("temperature", "0"), float, 0.0, 10.0),
        top_k=_number("top_k", fields.get("top_k", "0"), int, 0, 1_000_000),
        seed=_number("seed", fields.get("seed", "0"), int, 0, 2**31 - 1),
    )
    return prompt, settings


def _make_op_classes(model_dir: Path, limits: Limits, generation: str, threads: int):
    """The Paddle Serving classes of the service, built here because paddle_serving_server is imported only in the
    server process (serving/__init__.py applies its workarounds first)."""
    from paddle_serving_server.pipeline import RequestOp
    from paddle_serving_server.web_service import Op, WebService

    class UniqueKeysRequestOp(RequestOp):
        """Paddle Serving turns the request's key/value lists into a dict, so a repeated key would silently keep its
        last value; this is the documented extension point (`unpack_request_package`) to refuse it first."""

        def unpack_request_package(self, request):
            try:
                check_unique_keys(request.key)
            except RequestError as exc:
                return {}, request.logid, BAD_REQUEST, str(exc)
            return super().unpack_request_package(request)

    settings = {"model_dir": model_dir, "limits": limits, "generation": generation, "threads": threads}
    generate_op = type("GenerateOp", (GenerateMethods, Op), settings)

    class GenerateService(WebService):
        def get_pipeline_response(self, read_op):
            # The DAG is found from the response op back through input_ops: our request op replaces `read_op`.
            return generate_op(name=self.name, input_ops=[UniqueKeysRequestOp()])

    return GenerateService


class GenerateMethods:
    """preprocess (per request): validate, tokenize, pad to a fixed width so that Paddle Serving's auto-batching
    can stack requests; process (per batch): generate for every request of the batch at once; postprocess (per
    request): decode and add the lineage.

    Mixed in before Paddle Serving's Op by `_make_op_classes`, with the export directory, request limits,
    generation mode and threads per session as class attributes. The Op loads the export's programs itself, one
    session per worker thread or process (paddle.inference predictors are not thread-safe, and on CPU builds
    `Predictor.run()` holds the GIL, so only processes run inference in parallel). Paddle Serving calls `process()` only for Ops it built a client for from
    `local_service_conf.model_config`, which would load one more predictor per worker from "the first *.pdmodel"
    of the directory: the two overrides below declare the Op as serving without that client."""

    def init_from_dict(self, conf):
        super().init_from_dict(conf)
        self.with_serving = True

    def init_client(self, client_config, server_endpoints):
        return None

    def init_op(self):
        self.model = ExportedModel(self.model_dir)
        self.sessions = threading.local()

    def _session(self):
        session = getattr(self.sessions, "session", None)
        if session is None:
            if self.generation == "kv_cache":
                session = self.model.cached_session(self.threads)
            else:
                from core import exportdir
                predictor = exportdir.create_predictor(self.model.dir, threads=self.threads)
                session = lambda ids: exportdir.predict(predictor, ids)  # noqa: E731
            self.sessions.session = session
        return session

    def preprocess(self, input_dicts, data_id, log_id):
        import numpy as np

        ((_, fields),) = input_dicts.items()
        try:
            prompt, settings = parse_request(dict(fields), self.limits)
            ids = self.model.encode(prompt)
            if len(ids) > self.limits.max_prompt_chars:
                raise RequestError(f"prompt is {len(ids)} tokens; the limit is {self.limits.max_prompt_chars}")
        except RequestError as exc:
            return None, False, BAD_REQUEST, str(exc)
        padded = np.full((1, self.limits.max_prompt_chars), -1, dtype="int64")
        padded[0, :len(ids)] = ids
        feed = {"prompt_ids": padded,  # (first key: Paddle Serving counts a request's rows by it)
                "settings": np.asarray([[settings.max_new_tokens, settings.top_k, settings.seed]], "int64"),
                "temperature": np.asarray([settings.temperature], dtype="float64")}
        return feed, False, None, ""

    def process(self, feed_batch, typical_logid=0):
        import numpy as np

        feed = feed_batch[0]  # the requests of the batch, stacked along axis 0
        prompts = [[int(i) for i in row if i >= 0] for row in feed["prompt_ids"]]
        settings = [GenerationSettings(int(m), float(t), int(k), int(s))
                    for (m, k, s), t in zip(feed["settings"], feed["temperature"])]
        try:
            session = self._session()
            if self.generation == "kv_cache":
                outputs = self.model.generate_batch(session, prompts, settings)
            else:
                outputs = [self.model.generate(session, p, s) for p, s in zip(prompts, settings)]
        except Exception as exc:  # noqa: BLE001  (reported to the client; the server keeps serving)
            return None, INTERNAL_ERROR, f"generation failed: {exc.__class__.__name__}: {exc}"
        # One row per request: the Pipeline slices every output by the request's rows.
        ids = np.full((len(outputs), max(1, max(map(len, outputs)))), -1, dtype="int64")
        for row, out in enumerate(outputs):
            ids[row, :len(out)] = out
        return {"token_ids": ids, "batch_size": np.full((len(outputs),), len(outputs), dtype="int64")}, 0, ""

    def postprocess(self, input_dicts, fetch_dict, data_id, log_id):
        ids = [int(i) for i in fetch_dict["token_ids"][0] if i >= 0]
        return {"text": self.model.decode(ids), "token_ids": json.dumps(ids),
                "batch_size": str(int(fetch_dict["batch_size"][0])), **self.model.lineage()}, None, ""


def op_processes(serving_config) -> int:
    """Op workers: serving.op_concurrency, or (0) one per core this server may use."""
    from core.workarounds import cpu_runtime
    return serving_config.op_concurrency or cpu_runtime.available_cores()


def predictor_threads(serving_config) -> int:
    """Math threads of each Op worker's predictors: serving.predictor_threads, or (0) an even share of the cores.
    (In thread mode too: one predictor with 2 threads measured 1164 tokens/s at 8 clients, two with 1 thread each
    1635-1803; the model's matrices are too small for OpenMP to pay.)"""
    from core.workarounds import cpu_runtime
    return cpu_runtime.threads_per_process(serving_config.predictor_threads, op_processes(serving_config))


def render_config(config) -> dict:
    """Paddle Serving's config.yml, from the typed config (ports, workers, concurrency, batching)."""
    s = config.serving
    return {
        "worker_num": s.rpc_workers,
        "build_dag_each_worker": False,  # (True would switch auto-batching off)
        "rpc_port": s.rpc_port,
        "http_port": s.http_port,
        "dag": {"is_thread_op": s.op_mode == "thread", "retry": 1, "use_profile": False,
                "tracer": {"interval_s": -1}},
        "op": {
            s.service_name: {
                "concurrency": op_processes(s),
                "timeout": -1,
                "retry": 1,
                # requests that arrive within batch_timeout_ms of each other are generated together
                "batch_size": s.batch_size,
                "auto_batching_timeout": s.batch_timeout_ms if s.batch_size > 1 else -1,
                "local_service_conf": {},  # no model or client type: the Op loads its programs (see GenerateOp)
            }
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="rendered Paddle Serving config.yml")
    parser.add_argument("--service-config", required=True, help="the pipeline's resolved YAML config")
    parser.add_argument("--model", required=True, help="export directory")
    args = parser.parse_args()
    from core.config import load_config

    from core.workarounds import cpu_runtime

    from core import exportdir
    config = load_config(args.service_config)
    model_dir = Path(args.model)
    generation = config.serving.generation
    if generation == "kv_cache" and not exportdir.has_cache_programs(model_dir):
        print(f"{model_dir} has no cache programs (exported before they existed): serving the full-sequence graph",
              flush=True)
        generation = "full"
    threads = predictor_threads(config.serving)
    service_cls = _make_op_classes(model_dir, Limits.from_config(config.serving), generation, threads)
    if config.serving.op_mode == "thread":
        # Thread workers would otherwise import paddle in their own threads while Paddle Serving forks its gRPC
        # gateway from this one. paddle's import runs os.popen (paddle/base/core.py avx_supported); a fork at that
        # moment keeps the popen's exec-status pipe open in the gateway process, and the worker waits on it forever
        # (seen with py-spy: the server never answered). Imported here, before any worker thread or fork.
        ExportedModel(model_dir)
    service = service_cls(name=config.serving.service_name)
    service.prepare_pipeline_config(args.config)
    service.run_service()


if __name__ == "__main__":
    main()
