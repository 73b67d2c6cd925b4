"""`make smoke`: real HTTP and gRPC calls against the running service, checked against the export directory.

Checks: the liveness and readiness routes answer 200; answers have err_no 0; greedy output for the reference prompts
equals greedy generation in this process with the same exported graph (paddle.inference) and the dynamic model's
greedy tokens that export recorded (reference.json: the served path reproduces the checkpoint it came from, with no
training code needed here); the OpenAI-compatible route answers the same tokens; a bad request gets err_no != 0 and
the next good request succeeds; the lineage fields match the MLflow model registry.
"""
from __future__ import annotations

from pathlib import Path

import serving  # noqa: F401
from core import exportdir
from serving.engine import runtime
from serving.client.client import GenerationClient
from serving.protocol import GenerationSettings
from serving.engine.exported import ExportedModel


def run_smoke(state: dict, registry_client=None, log=print) -> list[str]:
    """Returns the list of failures (empty = pass)."""
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        log(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    client = GenerationClient(state["http_url"], state["rpc_address"], timeout=60)
    for route in ("live", "ready"):
        status = _status(f"{state['api_url']}/health/{route}")
        check(status == 200, f"/health/{route} answers 200 (got {status})")
    model = ExportedModel(Path(state["model_dir"]))
    predictor = runtime.create_predictor(model.dir)
    recorded = exportdir.read_references(model.dir)
    check(set(recorded) == set(exportdir.REFERENCE_PROMPTS),
          f"the export recorded the dynamic model's greedy tokens for {len(recorded)} reference prompts")
    n = exportdir.REFERENCE_NEW_TOKENS
    settings = GenerationSettings(max_new_tokens=n)
    for prompt in exportdir.REFERENCE_PROMPTS:
        http = client.generate(prompt, max_new_tokens=n)
        grpc = client.generate_grpc(prompt, max_new_tokens=n)
        log(f"     {prompt!r} -> {http.text!r} {http.token_ids}")
        check(http.token_ids == grpc.token_ids and http.text == grpc.text, f"{prompt!r}: HTTP == gRPC")
        check(0 < len(http.token_ids) <= n, f"{prompt!r}: 1..{n} new tokens")
        in_process = model.generate(lambda ids: runtime.predict(predictor, ids), model.encode(prompt), settings)
        check(http.token_ids == in_process, f"{prompt!r}: served greedy == in-process paddle.inference greedy")
        if prompt in recorded:
            check(http.token_ids == recorded[prompt], f"{prompt!r}: served greedy == the dynamic model's greedy "
                                                      f"(recorded at export)")
    openai_text = _completion(state, model.meta["registered_model_name"], exportdir.REFERENCE_PROMPTS[0], n)
    check(openai_text == client.generate(exportdir.REFERENCE_PROMPTS[0], max_new_tokens=n).text,
          "OpenAI-compatible /v1/completions == Paddle Serving's answer")

    answer = client.raw_http({"prompt": "", "max_new_tokens": "4"})
    check(answer["err_no"] == 8001 and "`prompt` is empty" in answer.get("err_msg", ""),
          f"empty prompt is rejected ({answer.get('err_msg', '')})")
    answer = client.raw_http({"prompt": "你好", "max_new_tokens": "many"})
    check(answer["err_no"] != 0 and "max_new_tokens" in answer.get("err_msg", ""),
          f"wrong type is rejected ({answer.get('err_msg', '')})")
    after = client.generate("你好", max_new_tokens=2)
    check(len(after.token_ids) >= 1, "the next good request succeeds")

    lineage = after
    check(lineage.model_name == model.meta["registered_model_name"] and lineage.model_version ==
          str(model.meta["version"]), f"lineage names the export ({lineage.model_name} v{lineage.model_version})")
    if registry_client is not None:
        version = registry_client.get_model_version(lineage.model_name, lineage.model_version)
        check(version.run_id == lineage.source_run_id, f"registry: version {version.version} comes from run "
              f"{version.run_id}")
        check(version.tags.get("checkpoint_step") == str(lineage.checkpoint_step),
              f"registry: checkpoint step {lineage.checkpoint_step}")
    return failures


def _status(url: str) -> int:
    import requests

    try:
        return requests.get(url, timeout=10).status_code
    except requests.RequestException:
        return -1


def _completion(state: dict, model: str, prompt: str, max_tokens: int) -> str | None:
    import requests

    try:
        answer = requests.post(f"{state['openai_base_url']}/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, timeout=60).json()
        return answer["choices"][0]["text"]
    except (requests.RequestException, KeyError, ValueError):
        return None
