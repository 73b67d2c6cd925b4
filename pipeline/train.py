"""`make train`: validate, prepare the run directory and data, open the MLflow run, launch the ranks, close the run.

The run ends FINISHED (all ranks exited 0), KILLED (interrupted) or FAILED (any rank failed: its log tail is
printed and attached to the run). `--resume` continues a run directory and the same MLflow run from its latest
complete checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from pipeline import REPO_ROOT, tracking
from pipeline.config import Config, ConfigError, load_config
from pipeline.layout import ParallelLayout, estimate_parameters

RUN_INFO = "mlflow_run.json"
LOG_TAIL_LINES = 40


def resolve_run_dir(resume: str, uri: str) -> Path:
    """A run directory, or an MLflow run id whose run recorded one."""
    if Path(resume).is_dir():
        return Path(resume).resolve()
    try:
        run = tracking.client(uri).get_run(resume)
    except Exception:  # noqa: BLE001  (MLflow raises several types for an unknown id)
        raise ConfigError(f"RESUME={resume}: neither a run directory nor a known MLflow run id") from None
    run_dir = run.data.tags.get(tracking.TAG_RUN_DIR)
    if not run_dir or not Path(run_dir).is_dir():
        raise ConfigError(f"RESUME={resume}: MLflow run has no run directory on this machine ({run_dir})")
    return Path(run_dir)


def launch_command(layout: ParallelLayout, run_dir: Path, resume_from: Path | None) -> list[str]:
    worker = ["--run-dir", str(run_dir)] + (["--resume-from", str(resume_from)] if resume_from else [])
    if layout.world_size == 1:
        return [sys.executable, "-m", "training.worker", *worker]
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(layout.procs_per_node),
           "--max_restart", "0", "--log_dir", str(run_dir / "logs")]
    if layout.nnodes > 1:
        # Multi-node: every node runs the same `make train`, with MASTER=<host:port> and NODE_RANK set.
        master = os.environ.get("MASTER")
        if not master:
            raise ConfigError("parallel.nnodes > 1: set MASTER=<host:port> of node 0 (and NODE_RANK) on every node")
        cmd += ["--nnodes", str(layout.nnodes), "--master", master, "--rank", os.environ.get("NODE_RANK", "0")]
    if layout.device == "gpu":
        cmd += ["--devices", os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(layout.procs_per_node))))]
    return cmd + [str(REPO_ROOT / "training" / "worker.py"), *worker]


def worker_env(config: Config, layout: ParallelLayout, uri: str, run_id: str | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["MLFLOW_TRACKING_URI"] = uri
    env["PYTHONUNBUFFERED"] = "1"  # progress reaches the terminal and the rank logs as it happens
    env.setdefault("PPNLP_HOME", str(REPO_ROOT / "runs" / ".paddlenlp"))
    if run_id:
        env["PIPELINE_MLFLOW_RUN_ID"] = run_id
    # A tracking-server outage must not stall training in MLflow's own retry loop (7 retries with backoff by
    # default): fail fast, and the logger buffers and re-sends (training/callbacks.py).
    env.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    env.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    if layout.device == "cpu":
        # 1F1B on gloo deadlocks unless sends are synchronous (read by fleet at import time).
        env["PADDLE_P2P_SYNC_SEND"] = "1"
    # Bounded collectives: a dead peer must end the job, not hang it.
    env.setdefault("FLAGS_gloo_timeout_seconds", str(config.parallel.collective_timeout_s))
    env.setdefault("FLAGS_nccl_timeout", str(config.parallel.collective_timeout_s))
    return env


_PEER_LOST = re.compile(r"TIMEOUT|IoException|Connection (?:reset|closed) by peer|Connection refused")
_PAIR_RANK = re.compile(r"pair_rank = (\d+)")
_ERROR = re.compile(r"Traceback|Error|terminate called|Termination signal|TIMEOUT")


def failing_rank(log_dir: Path) -> tuple[int, str, str] | None:
    """(rank, why, log tail) of the rank that most likely failed first.

    A rank that raised its own Python exception is the culprit. A rank killed from outside (OOM killer, SIGKILL)
    writes nothing: its log just stops, while its peers fail with gloo errors (TIMEOUT, connection reset)."""
    logs = {}
    for path in log_dir.glob("workerlog.*"):
        if path.suffix[1:].isdigit():
            logs[int(path.suffix[1:])] = path.read_text(errors="replace")
    if not logs:
        return None

    def tail(rank: int) -> str:
        return "\n".join(logs.get(rank, "").splitlines()[-LOG_TAIL_LINES:])

    own_error = [r for r, text in sorted(logs.items()) if "Traceback" in text and not _PEER_LOST.search(text)]
    if own_error:
        return own_error[0], "raised an exception", tail(own_error[0])
    peer_lost = {r: _PEER_LOST.search(text) for r, text in logs.items() if _PEER_LOST.search(text)}
    silent = [r for r, text in sorted(logs.items()) if not _ERROR.search(text)]
    if peer_lost and silent:
        witness = min(peer_lost)
        line = next(l for l in logs[witness].splitlines() if peer_lost[witness].group(0) in l).strip()
        return silent[0], f"stopped without an error (killed?); rank {witness} then lost its peer: {line}", \
            tail(silent[0])
    for rank, text in sorted(logs.items()):
        pair = _PAIR_RANK.search(text)
        if pair:
            return int(pair.group(1)), f"was lost by rank {rank} ({pair.group(0)})", tail(int(pair.group(1)))
    errored = [r for r, text in sorted(logs.items()) if _ERROR.search(text)]
    rank = errored[0] if errored else 0
    return rank, "reported an error" if errored else "exited non-zero", tail(rank)


def _run_launcher(cmd: list[str], env: dict, run_dir: Path, single: bool) -> int:
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if not single:
        return subprocess.run(cmd, env=env, cwd=REPO_ROOT).returncode
    # Single process: same log layout as the launcher (logs/workerlog.0), echoed to the terminal.
    with open(log_dir / "workerlog.0", "a") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
        finally:
            proc.wait()
    return proc.returncode


def run(config_path: str | None, overrides: list[str], resume: str = "", dry_run: bool = False) -> int:
    uri = tracking.tracking_uri()
    resume_from = None
    if resume:
        run_dir = resolve_run_dir(resume, uri)
        config = load_config(run_dir / "config.yaml", overrides)
        from training.checkpoints import latest_complete

        resume_from = latest_complete(run_dir)
    else:
        config = load_config(config_path, overrides)
        run_dir = None
    uri = tracking.tracking_uri(config)
    layout = ParallelLayout.from_config(config)
    params = estimate_parameters(config)
    print(f"model: {params / 1e9:.2f}B parameters (vocabulary <= {config.tokenizer.max_vocab_size}), about "
          f"{params / (layout.tp * layout.pp) / 1e9:.2f}B per rank\n" + layout.describe(), flush=True)
    if dry_run:
        return 0
    layout.check_fits_machine()
    tracking.check_reachable(uri)

    if run_dir is None:
        name = config.training.run_name or f"{config.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
        run_dir = (REPO_ROOT / config.training.runs_dir / name).resolve()
        if run_dir.exists():
            raise ConfigError(f"run directory {run_dir} exists; continue it with RESUME={run_dir} or pick another "
                              f"training.run_name")
        run_dir.mkdir(parents=True)
        try:
            (run_dir / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
            from training.data import prepare

            t0 = time.time()
            data = prepare(config, run_dir / "data", run_dir / "tokenizer")
            print(f"data: {data.train_documents} train / {data.validation_documents} validation documents -> "
                  f"{data.train_blocks} / {data.validation_blocks} blocks of {config.training.seq_length} tokens; "
                  f"vocabulary {data.vocab_size} (model {data.model_vocab_size}), validation unknown rate "
                  f"{data.unknown_rate:.4f}; {time.time() - t0:.1f}s", flush=True)
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing half-written is left behind
            raise
        (run_dir / "data" / "stats.json").write_text(json.dumps(asdict(data), indent=2))
    else:
        (run_dir / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
        print(f"resuming {run_dir} from {resume_from or 'the start (no complete checkpoint yet)'}", flush=True)

    run_id = None
    is_node0 = os.environ.get("NODE_RANK", "0") == "0"
    mlflow_client = tracking.client(uri)
    if is_node0:
        run_id = _open_run(mlflow_client, config, layout, run_dir, uri)
    single = layout.world_size == 1
    cmd = launch_command(layout, run_dir, resume_from)
    env = worker_env(config, layout, uri, run_id)
    status, returncode = "FAILED", 1
    try:
        returncode = _run_launcher(cmd, env, run_dir, single)
        status = "FINISHED" if returncode == 0 else "FAILED"
    except KeyboardInterrupt:
        status, returncode = "KILLED", 130
    finally:
        if status == "FAILED":
            _report_failure(mlflow_client, run_id, run_dir)
        if run_id:
            _close_run(mlflow_client, run_id, run_dir, status, uri)
    print(f"run directory: {run_dir}", flush=True)
    return returncode


def _open_run(mlflow_client, config: Config, layout: ParallelLayout, run_dir: Path, uri: str) -> str:
    """Create the MLflow run (or reopen the run directory's run on resume) and record what the run is."""
    info_file = run_dir / RUN_INFO
    if info_file.exists():
        run_id = json.loads(info_file.read_text())["run_id"]
        mlflow_client.update_run(run_id, status="RUNNING")
        return run_id
    import paddle
    import paddlenlp
    from mlflow.entities import Param, RunTag

    experiment = tracking.experiment_id(mlflow_client, config.tracking.experiment, uri)
    tags = {
        "mlflow.runName": run_dir.name, tracking.TAG_RUN_DIR: str(run_dir), tracking.TAG_LAYOUT: layout.name,
        "git_commit": tracking.git_commit(), "paddle_version": paddle.__version__,
        "paddlenlp_version": paddlenlp.__version__, "device": layout.device, "world_size": str(layout.world_size),
        **{f"layout.{k}": str(v) for k, v in layout.as_params().items()},
    }
    run = mlflow_client.create_run(experiment, tags=tags, run_name=run_dir.name)
    run_id = run.info.run_id
    params = {**config.flat(), **{f"layout.{k}": v for k, v in layout.as_params().items()}}
    stats = run_dir / "data" / "stats.json"
    if stats.exists():
        params.update({f"data_stats.{k}": v for k, v in json.loads(stats.read_text()).items()})
    items = [Param(k, str(v)[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):
        mlflow_client.log_batch(run_id, params=items[i:i + 100], tags=[RunTag("pipeline.stage", "train")] if i == 0
                                else [])
    mlflow_client.log_artifact(run_id, str(run_dir / "config.yaml"))
    mlflow_client.log_artifacts(run_id, str(run_dir / "tokenizer"), "tokenizer")
    info_file.write_text(json.dumps({"run_id": run_id, "experiment_id": experiment, "tracking_uri": uri}))
    print(f"MLflow run {run_id} in experiment {config.tracking.experiment!r}", flush=True)
    return run_id


def _close_run(mlflow_client, run_id: str, run_dir: Path, status: str, uri: str) -> None:
    from pipeline.compare import plot_run_losses
    from training.callbacks import send_unsent_metrics

    try:
        sent = send_unsent_metrics(mlflow_client, run_id, run_dir)
        if sent:
            print(f"MLflow: sent {sent} metrics buffered during a tracking outage", flush=True)
        if status == "FINISHED":
            png = plot_run_losses(mlflow_client, run_id, run_dir / "loss_curve.png")
            mlflow_client.log_artifact(run_id, str(png))
        mlflow_client.set_terminated(run_id, status)
        print(f"MLflow run {run_id}: {status} (tracking URI {uri})", flush=True)
    except Exception as exc:  # noqa: BLE001  (tracking server gone: say so, keep the run directory)
        print(f"MLflow run {run_id}: could not record status {status} ({exc.__class__.__name__}); unsent metrics "
              f"stay in {run_dir}", file=sys.stderr, flush=True)


def _report_failure(mlflow_client, run_id: str | None, run_dir: Path) -> None:
    found = failing_rank(run_dir / "logs")
    if not found:
        print("training failed before any rank wrote a log", file=sys.stderr)
        return
    rank, why, tail = found
    print(f"\ntraining failed: rank {rank} {why}\nlast lines of {run_dir / 'logs' / f'workerlog.{rank}'}:\n{tail}\n",
          file=sys.stderr, flush=True)
    if run_id:
        mlflow_client.log_text(run_id, tail, f"failure/workerlog.{rank}.tail.txt")
        mlflow_client.set_tag(run_id, "failed_rank", str(rank))


def stop_signal_handler() -> None:
    """SIGTERM behaves like Ctrl-C, so the run is closed as KILLED."""
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
