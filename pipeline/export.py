"""`make export`: best run (MLflow) -> best checkpoint -> static graph -> parity gate -> export directory + run
artifacts + registered model version.

    select()          the best checkpoint (lowest export.metric) of the best FINISHED run, or of RUN_ID
    fetch_inputs()    its checkpoint, config and tokenizer: from this machine's disk or the run's artifacts
    build()           convert (export/convert.py), gate on logits and on greedy tokens, write the export
                      directory's files (core/exportdir.py) in a staging directory
    publish()         log the directory to the source run (`exports/<name>/v<N>/`), register `runs:/...` (MLflow's
                      convention, which a tracking server accepts; a local path it refuses), rename staging into place

Publishing is all-or-nothing: the run artifacts, the registered version and the renamed directory are undone in
reverse order if a later step fails (e.g. the tracking server goes away).
"""
from __future__ import annotations

import json
import resource
import shutil
import tempfile
import time
from pathlib import Path

import core  # noqa: F401  (zlib before paddle)
from core import REPO_ROOT, exportdir, tracking
from core.config import Config, load_config
from core.workarounds import heap
from export import ExportError
from pipeline.runner.source_run import Selection, fetch_inputs, quiet_libraries, select
from core import chat
from export import hf
from pipeline.runner.cli import config_argument, overrides_argument
from serving.engine import runtime
from training.finetune.lora import LORA_CONFIG
from training.finetune.preference import held_out_task

HELP = "best checkpoint -> static graph, parity-checked, registered in MLflow"
OWN_OVERRIDES = True  # (applied to the source run's config, not to --config)


def arguments(p) -> None:
    config_argument(p, "; names the experiment to pick from")
    p.add_argument("--experiment", default="", help="MLflow experiment to pick the best run from")
    p.add_argument("--metric", default="", help="eval metric to minimise (default export.metric)")
    p.add_argument("--run-id", default="", help="export this run (latest: the newest finished one) instead of the "
                                                "best one")
    overrides_argument(p, "section.key=value on top of the source run's config, e.g. export.exports_dir=/data/exports")



def run(base: Config, experiment: str = "", metric: str = "", run_id: str = "",
        overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Select, fetch, build, publish. The export settings are the source run's config with `overrides` on top (e.g.
    `export.exports_dir=...` on the machine that exports); `base` (the verb's config) only names the experiment,
    metric and tracking URI to select from."""
    quiet_libraries()
    began = time.time()
    uri = tracking.tracking_uri(base.tracking)
    tracking.check_reachable(uri)
    client = tracking.client(uri)
    chosen = select(client, experiment or base.tracking.experiment, metric or base.export.metric, run_id)
    with tempfile.TemporaryDirectory(prefix="export-inputs-") as inputs:
        checkpoint, config_file, tokenizer_dir = fetch_inputs(client, chosen, Path(inputs))
        config = load_config(config_file, overrides)
        root = REPO_ROOT / config.export.exports_dir / config.export.registered_model_name
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
        try:
            meta = build(chosen, config, checkpoint, tokenizer_dir, staging)
            meta = publish(client, chosen, meta, staging, root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    t = meta["timings_s"]
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # (KiB on Linux)
    print(f"export took {time.time() - began:.1f}s (load {t['load_s']:.1f} / convert {t['convert_s']:.1f} / parity "
          f"{t['parity_s']:.1f} / MLflow model {t['mlflow_model_s']:.1f} s), peak memory {peak_gb:.1f} GiB; next: "
          f"make serve && make smoke", flush=True)
    return meta


# ---------------------------------------------------------------------------------------------------------------------
# build: convert, gate, write the export directory

def build(chosen: Selection, config: Config, checkpoint: Path, tokenizer_dir: Path, staging: Path) -> dict:
    """The export directory in `staging`; returns its export.json, written here for the gates (which read it
    through serving's ExportedModel) and written again by publish once the version is known."""
    from export import convert, gates, programs
    print(f"run {chosen.run_id} ({chosen.run_name}); checkpoint step {chosen.step} ({chosen.metric} "
          f"{chosen.metric_value:.5f}): {checkpoint}", flush=True)
    timings = {}
    t0 = time.time()
    model = convert.load_checkpoint(checkpoint)
    layout_error = gates.fused_weights_gate(model, checkpoint, config)
    merge_error = gates.lora_merge_gate(model, checkpoint, config)
    heap.release()  # (the checkpoint as trained, the gates' second model)
    timings["load_s"] = time.time() - t0
    t0 = time.time()
    programs.save_full_sequence(model, staging)
    programs.save_programs(model, staging)
    heap.release()  # (the fused decode weights: core/workarounds/heap.py)
    if config.export.hf:  # (the same weights for other engines: export/hf.py)
        hf.write(model, tokenizer_dir, staging)
    timings["convert_s"] = time.time() - t0
    t0 = time.time()
    shutil.copytree(tokenizer_dir, exportdir.tokenizer_dir(staging))
    vocab = model.config.vocab_size
    meta = export_meta(chosen, config, checkpoint, staging, model.config, layout_error, merge_error, timings)
    exportdir.write_meta(staging, meta)  # (read by the gates through serving's ExportedModel)
    expected = gates.dynamic_references(model, staging, config, task_prompts(config, tokenizer_dir))
    del model  # (each gate's predictors hold a copy of the weights: the model goes first, then one at a time)
    heap.release()
    predictor = runtime.create_predictor(staging)
    exportdir.write_serving_conf(staging, predictor.get_input_names()[0], predictor.get_output_names()[0], vocab)
    del predictor
    meta.update(gates.logits_gate(expected, staging, config))
    exportdir.write_meta(staging, meta)
    references = gates.tokens_gate(expected, staging)
    exportdir.write_references(staging, references)
    timings["parity_s"] = time.time() - t0  # (in meta["timings_s"]: publish writes export.json with the version)
    t0 = time.time()
    gates.mlflow_model_gate(staging, references)
    timings["mlflow_model_s"] = time.time() - t0
    return meta


def export_meta(chosen: Selection, config: Config, checkpoint: Path, staging: Path, model_config, layout_error,
                merge_error, timings: dict) -> dict:
    """export.json before the logits gate's figures and the version: lineage, shapes, weights' digest, timings."""
    import paddle

    from export import gates, programs

    return {
        "registered_model_name": config.export.registered_model_name, "version": None,
        "format_version": exportdir.FORMAT_VERSION, "decode_ops": programs.op_count(staging / exportdir.DECODE_PREFIX),
        "source_run_id": chosen.run_id, "source_run_name": chosen.run_name,
        "run_dir": str(Path(chosen.info["path"]).parent.parent), "checkpoint": chosen.info["path"],
        "checkpoint_step": chosen.step,
        "checkpoint_uri": f"runs:/{chosen.run_id}/{chosen.info['artifact']}" if chosen.info.get("artifact") else "",
        "metric": chosen.metric, "metric_value": chosen.metric_value, "config_hash": config.digest(),
        "paddle_version": paddle.__version__,
        "parity_tolerance": config.export.parity_tolerance, "parity_shapes": [list(s) for s in gates.PARITY_SHAPES],
        "vocab_size": model_config.vocab_size, "seq_length": config.training.seq_length,
        "max_position_embeddings": config.model.max_position_embeddings, "eos_token_id": model_config.eos_token_id,
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "weights_sha256": exportdir.weights_sha256(staging), "timings_s": timings,
        "trained_weight_layout": "fused" if layout_error is not None else "plain",
        "fused_vs_portable_max_abs_error": layout_error,
        **({"lora_merge_relative_error": merge_error} if merge_error is not None else {}),
        **({"hf_dir": "hf"} if config.export.hf else {}), **fine_tuning(config, checkpoint),
    }


TASK_PROMPTS = 20  # a fine-tuned model's held-out task prompts in the token gate


def fine_tuning(config: Config, checkpoint: Path) -> dict:
    """A fine-tuned model's lineage for export.json and the version's tags: its base and the adapter settings."""
    if not config.fine_tuning:
        return {}
    f = config.finetune
    found = {"base_model": f.base, "finetune_method": f.method, "finetune_data": f.data}
    if config.preference_tuning:  # (the reference is the base; the pairs' set as the run recorded it)
        stats = checkpoint.parent.parent / "data" / "stats.json"
        recorded = json.loads(stats.read_text()) if stats.is_file() else {}
        found.update(preference_set=recorded.get("data_set", ""),
                     **({"reference_model": f.base} if f.method == "dpo" else {}))

    if (checkpoint / LORA_CONFIG).is_file():
        found.update(lora_rank=f.lora_rank, lora_alpha=f.lora_alpha, lora_targets=",".join(f.lora_targets),
                     lora_merged=True)
    return found


def task_prompts(config: Config, tokenizer_dir: Path) -> tuple[str, ...]:
    """The first TASK_PROMPTS held-out examples of a fine-tuning run's data, rendered as the chat route renders them."""
    if not config.fine_tuning:
        return ()

    return tuple(e["prompt"] for e in held_out_task(config, chat.read(tokenizer_dir), TASK_PROMPTS))


# ---------------------------------------------------------------------------------------------------------------------
# publish: run artifacts -> registered version -> export directory, all or nothing

def publish(client, chosen: Selection, meta: dict, staging: Path, root: Path) -> dict:
    name = meta["registered_model_name"]
    try:
        version = next_version(client, name)
    except Exception as exc:  # noqa: BLE001  (tracking server unreachable)
        raise ExportError(f"the model registry is unreachable ({exc.__class__.__name__}); nothing was published") \
            from None
    target = root / str(version)
    if target.exists():
        raise ExportError(f"{target} exists but the registry's next version of {name!r} is {version}; move it "
                          f"away (it belongs to another tracking store) and export again")
    artifact_path = f"{tracking.EXPORT_ARTIFACTS}/{name}/v{version}"
    meta.update(version=version, artifact_uri=f"runs:/{chosen.run_id}/{artifact_path}")
    exportdir.write_meta(staging, meta)
    version_made = None
    try:
        client.log_artifacts(chosen.run_id, str(staging), artifact_path)
        version_made = register(client, name, chosen.run_id, artifact_path, description=(
            f"checkpoint-{chosen.step} of run {chosen.run_name}"), tags={
            "parity_max_abs_error": f"{meta['parity_max_abs_error']:.3e}", "checkpoint_step": str(chosen.step),
            "export_dir": str(target), "artifact_path": artifact_path, chosen.metric: f"{chosen.metric_value:.6f}",
            **{key: str(meta[key]) for key in FINE_TUNING_TAGS if key in meta}})
        if int(version_made.version) != version:  # another export registered concurrently: follow the registry
            version, target = int(version_made.version), root / version_made.version
            meta["version"] = version
            exportdir.write_meta(staging, meta)
            client.log_artifact(chosen.run_id, str(staging / exportdir.META_FILE), artifact_path)
            client.set_model_version_tag(name, version_made.version, "export_dir", str(target))
        root.mkdir(parents=True, exist_ok=True)
        staging.rename(target)  # atomic on one file system; fails if the directory appeared meanwhile
    except BaseException as exc:
        if version_made is not None:
            _quietly(lambda: client.delete_model_version(name, version_made.version))
        _delete_artifacts(client, chosen.run_id, artifact_path)
        if isinstance(exc, Exception) and not isinstance(exc, ExportError):
            first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
            raise ExportError(f"publishing failed ({exc.__class__.__name__}: {first_line}); nothing was published: "
                              f"no export directory, no registered version") from None
        raise
    _quietly(lambda: client.set_tag(chosen.run_id, "exported_versions", ",".join(filter(None, [
        client.get_run(chosen.run_id).data.tags.get("exported_versions"), str(version)]))))
    print(f"logged to runs:/{chosen.run_id}/{artifact_path}\nregistered model {name!r} version {version}: {target}",
          flush=True)
    return meta


FINE_TUNING_TAGS = ("base_model", "finetune_method", "finetune_data", "lora_rank", "lora_alpha", "lora_targets",
                    "preference_set", "reference_model")


def next_version(client, name: str) -> int:
    versions = client.search_model_versions(f"name='{name}'")
    return max((int(v.version) for v in versions), default=0) + 1


def register(client, name: str, run_id: str, artifact_path: str, tags: dict, description: str):
    """A model version whose source is the run's artifacts (`runs:/<run>/<path>`). If it fails, a registered model
    created for it is removed again."""
    from mlflow.exceptions import MlflowException

    created = False
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="Chinese causal LM exported by the train-to-serve pipeline")
        created = True
    try:
        return client.create_model_version(name, source=f"runs:/{run_id}/{artifact_path}", run_id=run_id,
                                           tags=tags, description=description)
    except BaseException:
        if created:
            _quietly(lambda: client.delete_registered_model(name))
        raise


def _quietly(action) -> None:
    try:
        action()
    except Exception:  # noqa: BLE001  (clean-up after a failure: the first error is the one to report)
        pass


def _delete_artifacts(client, run_id: str, path: str) -> None:
    """Remove what a failed export uploaded (stores that support deletion: local, mlflow-artifacts proxy)."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    _quietly(lambda: get_artifact_repository(client.get_run(run_id).info.artifact_uri).delete_artifacts(path))


def main(config: Config, args) -> int:
    run(config, args.experiment, args.metric, args.run_id, args.overrides)
    return 0
