"""`make export`: best run (MLflow) -> best checkpoint -> merged weights -> static graph (`paddle.jit.save`) ->
parity gate against the dynamic model -> export directory + registered model version.

The export directory `exports/<model-name>/<version>/` is everything serving needs:
    model.pdmodel, model.pdiparams    static graph, input `input_ids` int64 [batch, seq] -> logits [batch, seq, vocab]
    tokenizer/                        the run's tokenizer (save_pretrained form)
    serving_server_conf.prototxt      feed/fetch description for Paddle Serving's local_predictor
    export.json                       lineage and parity metadata
The same files are logged as artifacts of the source run (`exports/<model-name>/v<version>/`) and the registered
version's source is that run path (`runs:/<run>/exports/...`), so `make serve MODEL=models:/<name>/<version>` works on
any machine that reaches the tracking server. The checkpoint comes from the training machine's disk or, when it is
not there, from the run's artifacts (tracking.checkpoint_artifacts).

Publishing is all-or-nothing: the directory is built in a staging area, and the run artifacts, the registered version
and the renamed directory are undone in reverse order if a later step fails (e.g. the tracking server goes away).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline import REPO_ROOT, tracking  # (pipeline first: zlib before paddle)

import paddle  # noqa: E402
from pipeline.config import Config, ConfigError, load_config
from training import dy2static_fix
from training.checkpoints import COMPLETE_MARKER

MODEL_PREFIX = "model"
FEED_NAME = "input_ids"
# Parity batches: (batch, sequence length) pairs of different shapes; the last one uses the training length.
PARITY_SHAPES = ((1, 5), (2, 17), (3, 0))
# Paddle Serving's GeneralModelConfig type codes (paddle_serving_app/local_predict.py).
SERVING_TYPE_CODES = {"int64": 0, "float32": 1, "int32": 2}


class ExportError(ConfigError):
    """A reason the export cannot proceed; nothing has been published."""


@dataclass
class Selection:
    run_id: str
    run_name: str
    info: dict  # the checkpoint's record: step, path (on the training machine), eval metrics, artifact if uploaded
    metric: str

    @property
    def step(self) -> int:
        return int(self.info["step"])

    @property
    def metric_value(self) -> float:
        return float(self.info[self.metric])

    @property
    def local_checkpoint(self) -> Path | None:
        path = Path(self.info["path"])
        return path if (path / COMPLETE_MARKER).is_file() else None


# ---------------------------------------------------------------------------------------------------------------------
# Selection through the MLflow client.

def select(client, experiment: str, metric: str, run_id: str = "") -> Selection:
    """The best checkpoint (lowest `metric`) of the best FINISHED run, or of RUN_ID, that this machine can read:
    on its disk, or uploaded to the run's artifacts (tracking.checkpoint_artifacts)."""
    if run_id:
        try:
            run = client.get_run(run_id)
        except Exception:  # noqa: BLE001  (MlflowException for unknown ids, varies by store)
            raise ExportError(f"RUN_ID={run_id}: no such MLflow run") from None
    else:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise ExportError(f"EXPERIMENT={experiment}: no such MLflow experiment")
        runs = [r for r in client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'",
                                              order_by=[f"metrics.{metric} ASC"], max_results=200)
                if metric in r.data.metrics]
        if not runs:
            raise ExportError(f"experiment {experiment!r} has no FINISHED run with metric {metric!r}; train first")
        run = runs[0]
    refs = [a.path for a in client.list_artifacts(run.info.run_id, tracking.CHECKPOINT_ARTIFACTS)
            if not a.is_dir and a.path.endswith(".json")]
    candidates = []
    with tempfile.TemporaryDirectory() as tmp:
        for ref in refs:
            info = json.loads(Path(client.download_artifacts(run.info.run_id, ref, tmp)).read_text())
            if metric in info and ((Path(info["path"]) / COMPLETE_MARKER).is_file() or info.get("artifact")):
                candidates.append(info)
    if not candidates:
        raise ExportError(f"run {run.info.run_id} has no checkpoint with metric {metric!r} on this machine or in "
                          f"its MLflow artifacts ({len(refs)} recorded; see tracking.checkpoint_artifacts)")
    best = min(candidates, key=lambda info: (info[metric], -info["step"]))
    return Selection(run_id=run.info.run_id, run_name=run.info.run_name, info=best, metric=metric)


def fetch_inputs(client, chosen: Selection, scratch: Path) -> tuple[Path, Path, Path]:
    """(checkpoint, config.yaml, tokenizer/) of the chosen run: from the training machine's run directory when it
    is here, else downloaded from the run's MLflow artifacts into `scratch`."""
    checkpoint = chosen.local_checkpoint
    if checkpoint is not None:
        run_dir = checkpoint.parent.parent
        return checkpoint, run_dir / "config.yaml", run_dir / "tokenizer"
    print(f"checkpoint-{chosen.step} is not on this machine: downloading {chosen.info['artifact']} from the run's "
          f"MLflow artifacts", flush=True)
    try:
        checkpoint = Path(client.download_artifacts(chosen.run_id, chosen.info["artifact"], str(scratch)))
        config = Path(client.download_artifacts(chosen.run_id, "config.yaml", str(scratch)))
        tokenizer = Path(client.download_artifacts(chosen.run_id, "tokenizer", str(scratch)))
    except Exception as exc:  # noqa: BLE001  (store / network errors)
        raise ExportError(f"could not download checkpoint-{chosen.step} of run {chosen.run_id} "
                          f"({exc.__class__.__name__}: {str(exc)[:200]})") from None
    return checkpoint, config, tokenizer


# ---------------------------------------------------------------------------------------------------------------------
# Static-graph conversion.

def logits_only(model):
    import paddle

    class LogitsOnly(paddle.nn.Layer):
        """input_ids -> logits (the model itself returns a tuple / ModelOutput)."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids, use_cache=False, return_dict=False)[0]

    return LogitsOnly(model)


def save_static(model, prefix: Path) -> None:
    import paddle

    spec = [paddle.static.InputSpec(shape=[None, None], dtype="int64", name=FEED_NAME)]
    with dy2static_fix.jit_friendly_llama():
        static = paddle.jit.to_static(logits_only(model), input_spec=spec, full_graph=True)
        paddle.jit.save(static, str(prefix))


def create_predictor(model_dir: Path, ir_optim: bool = False):
    from paddle import inference

    config = inference.Config(str(model_dir / f"{MODEL_PREFIX}.pdmodel"), str(model_dir / f"{MODEL_PREFIX}.pdiparams"))
    config.disable_gpu()
    config.disable_glog_info()
    # Generation feeds a new sequence length at every step; with IR optimisation on, the CPU predictor measured
    # 2x slower per generated token (191 vs 75 ms for 8 tokens). Same setting as the served model (ir_optim: false).
    config.switch_ir_optim(ir_optim)
    return inference.create_predictor(config)


def predict(predictor, input_ids: np.ndarray) -> np.ndarray:
    handle = predictor.get_input_handle(predictor.get_input_names()[0])
    handle.reshape(list(input_ids.shape))
    handle.copy_from_cpu(input_ids.astype("int64"))
    predictor.run()
    return predictor.get_output_handle(predictor.get_output_names()[0]).copy_to_cpu()


def parity_error(model, predictor, vocab: int, seq_length: int, seed: int = 0) -> float:
    """Max |dynamic - paddle.inference| logit difference over batches of different shapes."""
    import paddle

    rng = np.random.RandomState(seed)
    worst = 0.0
    for batch, length in PARITY_SHAPES:
        ids = rng.randint(5, vocab, size=(batch, length or seq_length)).astype("int64")
        with paddle.no_grad():
            expected = logits_only(model)(paddle.to_tensor(ids)).numpy()
        worst = max(worst, float(np.abs(predict(predictor, ids) - expected).max()))
    return worst


def write_serving_conf(model_dir: Path, vocab: int) -> None:
    """serving_server_conf.prototxt (GeneralModelConfig, text format) -- written here because
    paddle_serving_client.io imports paddle.fluid, which Paddle 2.6 removed."""
    predictor = create_predictor(model_dir)
    feed, fetch = predictor.get_input_names()[0], predictor.get_output_names()[0]
    lines = ["feed_var {", f'  name: "{feed}"', f'  alias_name: "{feed}"', "  is_lod_tensor: false",
             f"  feed_type: {SERVING_TYPE_CODES['int64']}", "  shape: -1", "}",
             "fetch_var {", f'  name: "{fetch}"', f'  alias_name: "{fetch}"', "  is_lod_tensor: false",
             f"  fetch_type: {SERVING_TYPE_CODES['float32']}", "  shape: -1", f"  shape: {vocab}", "}"]
    (model_dir / "serving_server_conf.prototxt").write_text("\n".join(lines) + "\n")


def fetch_name(model_dir: Path) -> str:
    text = (model_dir / "serving_server_conf.prototxt").read_text()
    return text.split("fetch_var {")[1].split('name: "')[1].split('"')[0]


# ---------------------------------------------------------------------------------------------------------------------
# The stage.

def load_checkpoint(checkpoint: Path):
    from training.model import load_merged

    try:
        model = load_merged(checkpoint)
    except Exception as exc:  # noqa: BLE001  (safetensors / json / paddle errors on a damaged checkpoint)
        raise ExportError(f"checkpoint {checkpoint} is unreadable ({exc.__class__.__name__}: "
                          f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); pick another run or RUN_ID") from None
    model.eval()
    return model


def next_version(client, name: str) -> int:
    versions = client.search_model_versions(f"name='{name}'")
    return max((int(v.version) for v in versions), default=0) + 1


def register(client, name: str, run_id: str, artifact_path: str, tags: dict, description: str):
    """A model version whose source is the run's artifacts (`runs:/<run>/<path>`: MLflow's convention, which a
    tracking server accepts whatever its artifact store; a local path is refused by a server). If it fails, a
    registered model created for it is removed again."""
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


def run(experiment: str = "", metric: str = "", run_id: str = "", config_path: str | None = None,
        overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Select, convert, check and publish. Publishing is all-or-nothing: the export directory, the run artifacts
    and the registered version appear together, or none of them does.

    The export settings are the source run's config with `overrides` on top (e.g. `export.exports_dir=...` on the
    machine that exports); `config_path` only names the experiment, metric and tracking URI to select from."""
    base = load_config(config_path) if config_path else load_config(REPO_ROOT / "configs" / "tiny.yaml")
    uri = tracking.tracking_uri(base)
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
            return _export(client, chosen, config, checkpoint, tokenizer_dir, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _export(client, chosen: Selection, config: Config, checkpoint: Path, tokenizer_dir: Path, staging: Path) -> dict:
    import paddle

    timings = {}
    t0 = time.time()
    print(f"run {chosen.run_id} ({chosen.run_name}); checkpoint step {chosen.step} ({chosen.metric} "
          f"{chosen.metric_value:.5f}): {checkpoint}", flush=True)
    paddle.set_device("cpu")
    model = load_checkpoint(checkpoint)
    vocab = model.config.vocab_size
    timings["load_s"] = time.time() - t0

    name = config.export.registered_model_name
    root = staging.parent
    t1 = time.time()
    save_static(model, staging / MODEL_PREFIX)
    timings["convert_s"] = time.time() - t1
    t2 = time.time()
    # Both predictor configurations users run: plain (as served; bit-identical kernels) and IR-optimised
    # (fused passes change the arithmetic slightly). The gate takes the worse of the two.
    error = max(parity_error(model, create_predictor(staging, ir_optim), vocab, config.training.seq_length)
                for ir_optim in (False, True))
    timings["parity_s"] = time.time() - t2
    tolerance = config.export.parity_tolerance
    print(f"parity: max |dynamic - paddle.inference| = {error:.3e} over shapes {PARITY_SHAPES} and "
          f"ir_optim off/on (tolerance {tolerance:.0e})", flush=True)
    if not error <= tolerance:
        raise ExportError(f"parity check failed: max logit difference {error:.3e} > export.parity_tolerance "
                          f"{tolerance:.0e}; nothing was published")
    write_serving_conf(staging, vocab)
    shutil.copytree(tokenizer_dir, staging / "tokenizer")

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
    meta = {
        "registered_model_name": name, "version": version, "source_run_id": chosen.run_id,
        "source_run_name": chosen.run_name, "run_dir": str(Path(chosen.info["path"]).parent.parent),
        "checkpoint": chosen.info["path"], "checkpoint_step": chosen.step,
        "checkpoint_uri": f"runs:/{chosen.run_id}/{chosen.info['artifact']}" if chosen.info.get("artifact") else "",
        "artifact_uri": f"runs:/{chosen.run_id}/{artifact_path}", "metric": chosen.metric,
        "metric_value": chosen.metric_value, "config_hash": config.digest(), "paddle_version": paddle.__version__,
        "parity_max_abs_error": error, "parity_tolerance": tolerance, "parity_shapes": [list(s) for s in PARITY_SHAPES],
        "vocab_size": vocab, "seq_length": config.training.seq_length,
        "max_position_embeddings": config.model.max_position_embeddings,
        "eos_token_id": model.config.eos_token_id, "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "weights_sha256": hashlib.sha256((staging / f"{MODEL_PREFIX}.pdiparams").read_bytes()).hexdigest(),
        "timings_s": timings,
    }
    (staging / "export.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False))

    # Publish: run artifacts -> registered version -> export directory; undo the earlier steps if a later one fails.
    version_made = None
    try:
        client.log_artifacts(chosen.run_id, str(staging), artifact_path)
        version_made = register(client, name, chosen.run_id, artifact_path, description=(
            f"checkpoint-{chosen.step} of run {chosen.run_name}"), tags={
            "parity_max_abs_error": f"{error:.3e}", "checkpoint_step": str(chosen.step), "export_dir": str(target),
            "artifact_path": artifact_path, chosen.metric: f"{chosen.metric_value:.6f}"})
        if int(version_made.version) != version:  # another export registered concurrently: follow the registry
            version, target = int(version_made.version), root / version_made.version
            meta["version"] = version
            (staging / "export.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False))
            client.log_artifact(chosen.run_id, str(staging / "export.json"), artifact_path)
            client.set_model_version_tag(name, version_made.version, "export_dir", str(target))
        root.mkdir(parents=True, exist_ok=True)
        staging.rename(target)  # atomic on one file system; fails if the directory appeared meanwhile
    except BaseException as exc:
        if version_made is not None:
            _quietly(lambda: client.delete_model_version(name, version_made.version))
        _delete_artifacts(client, chosen.run_id, artifact_path)
        if isinstance(exc, Exception) and not isinstance(exc, ExportError):
            raise ExportError(f"publishing failed ({exc.__class__.__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                              f"nothing was published: no export directory, no registered version") from None
        raise
    _quietly(lambda: client.set_tag(chosen.run_id, "exported_versions", ",".join(filter(None, [
        client.get_run(chosen.run_id).data.tags.get("exported_versions"), str(version)]))))
    print(f"logged to runs:/{chosen.run_id}/{artifact_path}\nregistered model {name!r} version {version}: {target}",
          flush=True)
    return meta
