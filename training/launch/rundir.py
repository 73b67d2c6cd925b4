"""Run directories: `runs/<name>/` holds a run's resolved config, tokenizer, the link to its data set, checkpoints, logs and the
link to its MLflow run. Claimed atomically (runs started together never share one), prepared completely or not at
all, and found again by path or MLflow run id for a resume."""
from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
import tempfile

from core import REPO_ROOT, tracking
from core.config import Config, ConfigError, load_config
from training.launch.supervise import stop_signal_handler
from core.storage import Store, StoreError
from training import data
from training.checkpoint import in_store as checkpoint_store
from training.finetune import data as sft
from training.finetune import preference
from training.launch import liveness
from training.launch.tracked_run import RUN_INFO, write_run_info


def find(resume: str, uri: str) -> Path:
    """A run directory, or an MLflow run id whose run recorded one."""
    if Path(resume).is_dir():
        return Path(resume).resolve()
    try:
        run = tracking.client(uri).get_run(resume)
    except Exception:  # noqa: BLE001  (MLflow raises several types for an unknown id)
        raise ConfigError(f"RESUME={resume}: neither a run directory nor a run id in the tracking store "
                          f"{tracking.display_uri(uri)} (tracking.tracking_uri, else $MLFLOW_TRACKING_URI)") from None
    run_dir = run.data.tags.get(tracking.TAG_RUN_DIR)
    if run_dir and Path(run_dir).is_dir():
        return Path(run_dir)
    return restore(run, uri, resume)


def restore(run, uri: str, resume: str) -> Path:
    """A run begun on another machine, made again here from its MLflow record and the object store: its recorded
    config (storage.uri included), its data set (prepared here from the same corpus: the same content key), and its
    latest checkpoint complete in the store (docs/storage.md). A store that fails (past storage.retry_s) ends it in
    one line; the MLflow run is tagged with it and, if nothing runs it any more, marked FAILED; nothing is left here."""
    client = tracking.client(uri)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            config = load_config(Path(client.download_artifacts(run.info.run_id, "config.yaml", tmp)))
        except Exception:  # noqa: BLE001  (no such artifact, or the store behind it is unreachable)
            config = None
    recorded = run.data.tags.get(tracking.TAG_RUN_DIR) or ""
    if config is None or not config.storage.uri:
        raise ConfigError(f"RESUME={resume}: the MLflow run has no run directory on this machine ({recorded}) and no "
                          "storage.uri to restore it from; resume on the machine that has it, or train with "
                          "storage.uri=s3://... so that checkpoints outlive a disk")
    name = Path(recorded).name or run.info.run_name
    run_dir = runs_root(config.training) / name

    if _run_id_of(run_dir / RUN_INFO) == run.info.run_id:
        return run_dir  # (restored here before: this machine's copy of the run, under its own runs_dir)
    if run_dir.exists():
        raise ConfigError(f"RESUME={resume}: {run_dir} exists but is not the run's directory ({recorded}); move it")
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        run_dir.mkdir()
        with _removed_on_failure(run_dir):
            _fill(config, run_dir)
            write_run_info(run_dir, run.info.run_id, run.info.experiment_id, uri)
            store = Store.of(config.storage)
            fetched = checkpoint_store.fetch_latest(store, run_dir)
            if fetched:
                checkpoint, size, seconds = fetched
                print(f"restored {name} from {store.uri}: {checkpoint.name} ({size / 2**20:.1f} MB in "
                      f"{seconds:.1f}s)", flush=True)
            else:
                print(f"restored {name} from its MLflow record: no checkpoint complete in {store.uri} yet, it starts "
                      "over", flush=True)
    except StoreError as exc:
        _record_unresumed(client, run, config, f"RESUME={resume}: {exc}")
        raise StoreError(f"RESUME={resume}: {exc}; nothing was kept here, run it again once the store answers",
                         exc.kind) from None
    return run_dir


def _record_unresumed(client, run, config: Config, line: str) -> None:
    """A resume the store stopped: the line on the MLflow run (`pipeline.resume_failed`), and a RUNNING run whose
    launcher is gone marked FAILED as training/launch/liveness.py marks it (still resumable)."""
    try:
        client.set_tag(run.info.run_id, "pipeline.resume_failed", line[:5000])
        if run.info.status == "RUNNING":
            state, why = liveness.liveness(run.data.tags, time.time(), config.tracking.stale_after_s)
            if state != "alive":
                client.set_tag(run.info.run_id, "pipeline.reaped", f"{state}: {why}")
                client.set_terminated(run.info.run_id, "FAILED")
    except Exception:  # noqa: BLE001  (the tracking store failing too: the console line is what remains)
        pass


def _run_id_of(run_info: Path) -> str:
    try:
        return json.loads(run_info.read_text())["run_id"]
    except (OSError, ValueError, KeyError):
        return ""


def join_locally(config: Config, run_dir: Path, info: dict, store) -> tuple[Path | None, Path | None]:
    """Node k > 0 of nodes that share no filesystem: its own run directory, made from its config (node 0's: the
    announcement checked it) when this disk has none, and the announced checkpoint fetched from the store.
    (where the ranks resume from, the pending config)"""
    if not run_dir.exists():
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        run_dir.mkdir()
        with _removed_on_failure(run_dir):
            _fill(config, run_dir)
    resume_from = None
    if info["resume_checkpoint"]:
        step = int(info["resume_checkpoint"].split("-")[1])
        resume_from = checkpoint_store.fetch_step(store, run_dir, step)
        if resume_from is None:
            raise ConfigError(f"node 0 resumes from {info['resume_checkpoint']}, which is not complete in {store.uri}")
    pending = None
    if info["pending_config"]:
        pending = run_dir / Path(info["pending_config"]).name
        pending.write_text(config.to_yaml(), encoding="utf-8")
    return resume_from, pending


def runs_root(training) -> Path:
    """training.runs_dir (the config's training section), resolved."""
    return (REPO_ROOT / training.runs_dir).resolve()


def claim(config: Config) -> Path:
    """A new, empty run directory, claimed atomically (mkdir): runs started at the same moment never share one.
    Default names are `<config>-<UTC time>`, with `-2`, `-3`, ... when that second's name is taken."""
    root = runs_root(config.training)
    root.mkdir(parents=True, exist_ok=True)
    if config.training.run_name:
        try:
            (root / config.training.run_name).mkdir()
        except FileExistsError:
            raise ConfigError(f"training.run_name={config.training.run_name!r} is taken: {root / config.training.run_name}"
                              f" holds another run; pick another training.run_name (or leave it empty for a "
                              f"generated one)") from None
        return root / config.training.run_name
    base = f"{config.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    for n in range(1, 10_000):
        run_dir = root / (base if n == 1 else f"{base}-{n}")
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            continue
    raise ConfigError(f"could not find a free run name {base}-<n> under {root}")


def create(config: Config) -> Path:
    """Create runs/<name>/ with the resolved config, tokenizer and the link to its prepared data (made now if
    missing: `make data`); nothing is left if this fails."""
    run_dir = claim(config)
    with _removed_on_failure(run_dir):
        _fill(config, run_dir)
    return run_dir


@contextlib.contextmanager
def _removed_on_failure(run_dir: Path):
    try:
        yield
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing half-written is left behind
        raise


def _fill(config: Config, run_dir: Path) -> None:
    """A claimed run directory's config, tokenizer and data (the set prepared now if missing, its sample index)."""
    (run_dir / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
    t0 = time.time()
    import paddlenlp  # noqa: F401  (the sample index needs it; its import resets SIGTERM to the default action,
    stop_signal_handler()  # so re-arm: a SIGTERM during data preparation still removes the half-made run)
    if config.fine_tuning:  # (a fine-tuning run: the base's tokenizer with the chat template, its examples)
        (preference if config.preference_tuning else sft).for_run(config, run_dir, Path(config.tokenizer.path),
                                                                  log=lambda line: print(line, flush=True))
        return

    stats, prepared = data.for_run(config, run_dir, log=lambda line: print(line, flush=True))
    print(f"data: {stats['train_documents']:,} train / {stats['validation_documents']:,} validation documents, "
          f"{stats['train_tokens']:,} / {stats['validation_tokens']:,} tokens in {stats['shards']} shard(s) -> "
          f"{stats['train_blocks']:,} / {stats['validation_blocks']:,} blocks of {config.training.seq_length} "
          f"tokens; vocabulary {stats['vocab_size']} (model {stats['model_vocab_size']}), validation unknown rate "
          f"{stats['unknown_rate']:.4f}; {time.time() - t0:.1f}s"
          + (f" (prepared data reused: {prepared.path})" if prepared.reused else f" ({prepared.path})"), flush=True)
