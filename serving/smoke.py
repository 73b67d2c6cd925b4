"""`make smoke`: real HTTP and gRPC calls against the running service, checked against in-process generation.

Checks: answers have err_no 0; greedy output for fixed prompts equals greedy generation in this process with the
same exported graph (paddle.inference) and with the dynamic model from the source checkpoint; a bad request gets
err_no != 0 and the next good request succeeds; the lineage fields match the MLflow model registry.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import serving  # noqa: F401
from serving.client import GenerationClient, ServingError
from serving.generation import GenerationSettings
from serving.service import ExportedModel

PROMPTS = ("人工智能", "这本书", "快递很快，")
MAX_NEW_TOKENS = 8


def source_checkpoint(meta: dict, registry_client, scratch: Path, log=print) -> Path | None:
    """The export's source checkpoint: on this machine, else downloaded from the run's artifacts when it was
    uploaded (tracking.checkpoint_artifacts), else None."""
    local = Path(meta["checkpoint"])
    if local.is_dir():
        return local
    uri = meta.get("checkpoint_uri", "")
    if not uri or registry_client is None:
        return None
    from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository

    run_id, path = RunsArtifactRepository.parse_runs_uri(uri)
    log(f"     downloading the source checkpoint {uri}")
    return Path(registry_client.download_artifacts(run_id, path, str(scratch)))


def in_process_generators(model: ExportedModel, checkpoint: Path | None):
    """forward() callables for the exported graph (paddle.inference) and, when its checkpoint is at hand, the
    dynamic model it was exported from."""
    import paddle

    from training.export import create_predictor, predict
    from training.model import load_merged

    predictor = create_predictor(model.dir)
    forwards = {"paddle.inference": lambda ids: predict(predictor, ids)}
    if checkpoint is not None:
        dynamic = load_merged(checkpoint)
        dynamic.eval()

        def dynamic_forward(ids):
            with paddle.no_grad():
                return dynamic(paddle.to_tensor(ids), use_cache=False, return_dict=False)[0].numpy()

        forwards["dynamic"] = dynamic_forward
    return forwards


def run_smoke(state: dict, registry_client=None, log=print) -> list[str]:
    """Returns the list of failures (empty = pass)."""
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        log(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    client = GenerationClient(state["http_url"], state["rpc_address"], timeout=60)
    model = ExportedModel(Path(state["model_dir"]))
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = source_checkpoint(model.meta, registry_client, Path(scratch), log)
        if checkpoint is None:
            log(f"note: the source checkpoint {model.meta['checkpoint']} is neither on this machine nor in MLflow: "
                f"served output is compared with the exported graph only")
        references = in_process_generators(model, checkpoint)
    settings = GenerationSettings(max_new_tokens=MAX_NEW_TOKENS)
    for prompt in PROMPTS:
        http = client.generate(prompt, max_new_tokens=MAX_NEW_TOKENS)
        grpc = client.generate_grpc(prompt, max_new_tokens=MAX_NEW_TOKENS)
        log(f"     {prompt!r} -> {http.text!r} {http.token_ids}")
        check(http.token_ids == grpc.token_ids and http.text == grpc.text, f"{prompt!r}: HTTP == gRPC")
        check(0 < len(http.token_ids) <= MAX_NEW_TOKENS, f"{prompt!r}: 1..{MAX_NEW_TOKENS} new tokens")
        for name, forward in references.items():
            expected = model.generate(forward, model.encode(prompt), settings)
            check(http.token_ids == expected, f"{prompt!r}: served greedy == in-process {name} greedy")

    try:
        client.generate("", max_new_tokens=4)
        check(False, "empty prompt is rejected")
    except ServingError as exc:
        check(exc.err_no != 0 and "prompt is empty" in exc.message, f"empty prompt is rejected ({exc.message})")
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
