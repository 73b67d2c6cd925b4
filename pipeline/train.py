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
import threading
import time
from dataclasses import asdict
from pathlib import Path

from pipeline import REPO_ROOT, console, cpu_runtime, nodes, runs, tracking
from pipeline.config import Config, ConfigError, PerformanceConfig, load_config
from pipeline.layout import ParallelLayout, estimate_parameters
from pipeline.processes import child_dies_with_parent, descendants, signal_pids

RUN_INFO = "mlflow_run.json"
# A resume's config waits here until the resumed run has completed a step (training/callbacks.py PromoteConfig).
PENDING_CONFIG = "config.next.yaml"
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


def launch_command(layout: ParallelLayout, run_dir: Path, resume_from: Path | None,
                   pending_config: Path | None = None) -> list[str]:
    worker = ["--run-dir", str(run_dir)] + (["--resume-from", str(resume_from)] if resume_from else []) + \
        (["--pending-config", str(pending_config)] if pending_config else [])
    if layout.world_size == 1:
        return [sys.executable, "-m", "training.worker", *worker]
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(layout.procs_per_node),
           "--max_restart", "0", "--log_dir", str(nodes.log_dir(run_dir, layout.nnodes))]
    if layout.nnodes > 1:
        # Multi-node: every node runs the same `make train`, with MASTER=<host:port> and NODE_RANK set (`run` checks
        # MASTER before it opens anything).
        cmd += ["--nnodes", str(layout.nnodes), "--master", os.environ["MASTER"], "--rank",
                os.environ.get("NODE_RANK", "0")]
    if layout.device == "gpu":
        cmd += ["--devices", os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(layout.procs_per_node))))]
    return cmd + [str(REPO_ROOT / "training" / "worker.py"), *worker]


def worker_env(config: Config, layout: ParallelLayout, uri: str, run_id: str | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["MLFLOW_TRACKING_URI"] = uri
    env["PYTHONUNBUFFERED"] = "1"  # progress reaches the terminal and the rank logs as it happens
    env.setdefault("PPNLP_HOME", str(REPO_ROOT / "runs" / ".paddlenlp"))
    env.setdefault("GLOG_minloglevel", "2")  # Paddle's C++ INFO/WARNING lines ("New Executor is Running", ...)
    if run_id:
        env["PIPELINE_MLFLOW_RUN_ID"] = run_id
    # A tracking-server outage must not stall training in MLflow's own retry loop (7 retries with backoff by
    # default): fail fast, and the logger buffers and re-sends (training/callbacks.py).
    env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
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


def rank_logs(log_dir: Path, procs_per_node: int = 1) -> dict[int, Path]:
    """global rank -> its log: `workerlog.<rank>`, or on several nodes `node<k>/workerlog.<local rank>` (the launcher
    numbers logs per node; ranks are numbered node by node)."""
    def numbered(folder: Path) -> dict[int, Path]:
        return {int(p.suffix[1:]): p for p in folder.glob("workerlog.*") if p.suffix[1:].isdigit()}

    found = numbered(log_dir)
    for folder in log_dir.glob("node*"):
        if folder.name[4:].isdigit():
            found.update({int(folder.name[4:]) * procs_per_node + local: p for local, p in numbered(folder).items()})
    return found


def failing_rank(logs: dict[int, str]) -> tuple[int, str, str] | None:
    """(rank, why, log tail) of the rank that most likely failed first, from each rank's log text.

    A rank that raised its own Python exception is the culprit. A rank killed from outside (OOM killer, SIGKILL)
    writes nothing: its log just stops, while its peers fail with gloo errors (TIMEOUT, connection reset)."""
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


class Stopper:
    """SIGTERM / SIGINT to the launcher (Slurm's time limit, pod eviction, `kill`, Ctrl-C).

    The first signal is forwarded once, as SIGTERM, to every rank: they finish the current step, save a complete
    checkpoint and exit (training/callbacks.py GracefulStop). Ranks are signalled directly, not through
    paddle.distributed.launch, whose own handler gives them a fixed 30 s and closes their logs. Whatever still runs
    `grace_s` after the signal (or after a second Ctrl-C) is killed. The ranks run in their own session, so a
    terminal's Ctrl-C reaches them only through this forwarding (once, not twice)."""

    def __init__(self, grace_s: float):
        self.grace_s, self.signum, self.first_at, self.proc, self.single = grace_s, 0, 0.0, None, True

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def attach(self, proc: subprocess.Popen, single: bool) -> None:
        self.proc, self.single = proc, single
        if self.signum:  # signalled while starting
            self._forward()

    def _ranks(self) -> list[int]:
        return [self.proc.pid] if self.single else descendants(self.proc.pid)

    def _handle(self, signum, frame):
        if self.signum:
            # A repeated SIGTERM is usually the same request by two routes (`kill` of a process group, `timeout`,
            # make forwarding): ignore it. A second Ctrl-C, pressed a moment later, means "now".
            if signum == signal.SIGINT and time.time() - self.first_at > 1.0:
                print("\nSIGINT again: stopping now", file=sys.stderr, flush=True)
                self.kill()
            return
        self.signum, self.first_at = signum, time.time()
        print(f"\n{signal.Signals(signum).name}: the ranks save a checkpoint after the current step and stop "
              f"(killed after {self.grace_s:g}s)", file=sys.stderr, flush=True)
        if self.proc:
            self._forward()

    def _forward(self) -> None:
        signal_pids(self._ranks(), signal.SIGTERM)
        timer = threading.Timer(self.grace_s, self.kill)
        timer.daemon = True
        timer.start()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            signal_pids(descendants(self.proc.pid) + [self.proc.pid], signal.SIGKILL)


class Heartbeat(threading.Thread):
    """Stamps the MLflow run every `interval_s` while the launcher lives (stale runs: pipeline/runs.py)."""

    def __init__(self, mlflow_client, run_id: str, interval_s: float):
        super().__init__(daemon=True)
        self.client, self.run_id, self.interval_s, self.done = mlflow_client, run_id, interval_s, threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval_s):
            try:
                self.client.set_tag(self.run_id, tracking.TAG_HEARTBEAT, str(int(time.time())))
            except Exception:  # noqa: BLE001  (tracking outage: the metrics buffer says so; try again next beat)
                pass


def _run_launcher(cmd: list[str], env: dict, run_dir: Path, log_dir: Path, single: bool, stopper: Stopper,
                  on_start=lambda: None) -> int:
    """Run the ranks; their output (PaddleNLP's, Paddle's) goes to the logs under `log_dir`, not to the console:
    one process writes logs/workerlog.0 itself, paddle.distributed.launch writes workerlog.<rank> and its own
    output (which repeats rank 0's) to launcher.log. The console shows pipeline/console.py's progress instead."""
    log_dir.mkdir(parents=True, exist_ok=True)
    # Own session: signals reach the ranks only through the Stopper. The child gets SIGTERM if this process dies.
    options = dict(env=env, cwd=REPO_ROOT, start_new_session=True, preexec_fn=child_dies_with_parent())
    if not single:
        with open(log_dir / "launcher.log", "a") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **options)
        stopper.attach(proc, single)
        on_start()
        return proc.wait()
    # One process: its output through a pipe into logs/workerlog.0 (the launcher's layout), so that a full disk
    # costs log lines, never the rank (a print that fails would raise in it).
    log = open(log_dir / "workerlog.0", "a")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, **options)
    stopper.attach(proc, single)
    on_start()
    try:
        for line in proc.stdout:
            try:
                log.write(line)
                log.flush()
            except OSError as exc:
                if not log.closed:
                    print(f"cannot write {log.name} ({exc.strerror}); the rest of the rank's output is lost",
                          file=sys.stderr, flush=True)
                    _close_quietly(log)
    finally:
        proc.wait()
        _close_quietly(log)
    return proc.returncode


def _close_quietly(fh) -> None:
    try:
        fh.close()
    except OSError:
        pass


def run(config_path: str | None, overrides: list[str], resume: str = "", dry_run: bool = False) -> int:
    uri = tracking.tracking_uri()
    resume_from = previous = None
    if resume:
        run_dir = resolve_run_dir(resume, uri)
        previous = load_config(run_dir / "config.yaml")
        config = load_config(run_dir / "config.yaml", overrides)
        from training.checkpoints import latest_complete

        resume_from = latest_complete(run_dir)
        if resume_from and "semi_auto" in (previous.parallel.mode, config.parallel.mode):
            raise ConfigError(f"RESUME={resume}: parallel.mode=semi_auto checkpoints hold the model's weights but no "
                              "optimizer state, so that run cannot resume (training/semi_auto.py); start a new run "
                              f"with model.init_from={resume_from} instead")
    else:
        config = load_config(config_path, overrides)
        run_dir = None
    uri = tracking.tracking_uri(config)
    layout = ParallelLayout.from_config(config)
    params = estimate_parameters(config)
    print(f"model: {_count(params)} parameters (vocabulary <= {config.tokenizer.max_vocab_size}), about "
          f"{_count(params / (layout.tp * layout.pp))} per rank\n" + layout.describe(), flush=True)
    if layout.pp > 1:
        print(pipeline_schedule_text(layout), flush=True)
    print(performance_text(config, layout), flush=True)
    if dry_run:
        return 0
    layout.check_fits_machine()
    if layout.nnodes > 1 and not os.environ.get("MASTER"):
        raise ConfigError("parallel.nnodes > 1: set MASTER=<host:port> of node 0 (and NODE_RANK) on every node")
    if layout.nnodes > 1 and run_dir is None and not config.training.run_name:
        raise ConfigError("parallel.nnodes > 1: set training.run_name, the same on every node (e.g. "
                          "training.run_name=$SLURM_JOB_NAME-$SLURM_JOB_ID): it names the run directory on shared "
                          "storage where the nodes meet")
    if nodes.node_rank() != 0:
        # The other nodes' launchers never touch the tracking store: node 0 owns the run directory and MLflow run.
        return _run_other_node(config, layout, run_dir or _runs_root(config) / config.training.run_name, uri)
    tracking.check_reachable(uri)
    mlflow_client = tracking.client(uri)
    for line in runs.reap(mlflow_client, config.tracking.experiment, config.tracking.stale_after_s):
        print(f"marked stale run FAILED: {line}", flush=True)

    pending = None
    if run_dir is None:
        run_dir = _new_run_dir(config)
    else:
        # The new config (maybe another layout) goes live only once the resumed run has completed a step.
        pending = run_dir / PENDING_CONFIG
        from training.checkpoints import remove_partial

        for path in remove_partial(run_dir):  # (a save the interruption cut short: it would be written again)
            print(f"removed the partial {path.name} left by the interrupted run", flush=True)
        old_layout = ParallelLayout.from_config(previous).name
        changed = f"; layout {old_layout} -> {layout.name}" if old_layout != layout.name else ""
        print(f"resuming {run_dir} from {resume_from or 'the start (no complete checkpoint yet)'}{changed}",
              flush=True)

    stopper = Stopper(config.training.stop_grace_s)
    stopper.install()  # here: data preparation imported paddlenlp, which resets SIGTERM
    run_id, previous_status = _open_run(mlflow_client, config, layout, run_dir, uri)
    print(header(mlflow_client, run_dir, run_id, uri, layout), flush=True)
    began = time.time()
    heartbeat = Heartbeat(mlflow_client, run_id, config.tracking.heartbeat_s) if run_id else None
    if pending is not None:
        pending.write_text(config.to_yaml(), encoding="utf-8")
    if layout.nnodes > 1:
        nodes.announce(run_dir, config.to_yaml(), resume_from, pending)
    cmd = launch_command(layout, run_dir, resume_from, pending)
    env = worker_env(config, layout, uri, run_id)
    status, returncode = "FAILED", 1
    try:
        # (The heartbeat thread starts after the fork, so the child's preexec_fn never races a thread.)
        from training.checkpoints import STOPPED_MARKER

        stopped = run_dir / STOPPED_MARKER
        stopped.unlink(missing_ok=True)
        if not stopper.signum:  # (a signal while the run was being opened: do not start the ranks at all)
            progress = console.Progress(run_dir)

            def started():  # (threads start after the fork, so the child's preexec_fn never races one)
                progress.start()
                if heartbeat:
                    heartbeat.start()

            try:
                returncode = _run_launcher(cmd, env, run_dir, nodes.log_dir(run_dir, layout.nnodes),
                                           layout.world_size == 1, stopper, started)
            finally:
                progress.stop()
        if stopped.exists() and not stopper.signum:
            info = json.loads(stopped.read_text())
            if returncode == 0:
                print(f"the ranks were signalled directly and stopped early ({info}); the run is KILLED",
                      file=sys.stderr, flush=True)
                stopper.signum = info["signal"]
            else:
                print(f"the ranks were signalled directly ({info}) but did not all stop cleanly (exit code "
                      f"{returncode}); the run is FAILED", file=sys.stderr, flush=True)
        # KILLED: the launcher was signalled, or the ranks were and then all exited cleanly. A rank that failed after
        # agreeing to stop (its peer machine died mid-save, say) makes the run FAILED, with its log attached.
        status = "KILLED" if stopper.signum else "FINISHED" if returncode == 0 else "FAILED"
    finally:
        if heartbeat:
            heartbeat.done.set()
        if layout.nnodes > 1:
            nodes.withdraw(run_dir)
        started = pending is None or not pending.exists()
        if pending is not None and not started:
            # The resume never completed a step: the run stays as it was (config.yaml, MLflow status).
            pending.unlink(missing_ok=True)
            print(f"the resume did not complete a step; {run_dir / 'config.yaml'} and the MLflow run's status "
                  f"({previous_status}) are unchanged", file=sys.stderr, flush=True)
        if status == "FAILED":
            _report_failure(mlflow_client if started else None, run_id, run_dir, layout)
        elif layout.pp > 1 and started:
            _report_stages(mlflow_client, run_id, run_dir, layout)
        if run_id:
            if not started:
                status = previous_status
            elif previous is not None and old_layout != layout.name:
                _record_new_layout(mlflow_client, run_id, layout, resume_from)
            _close_run(mlflow_client, run_id, run_dir, status, uri)
    if stopper.signum:
        returncode = 128 + stopper.signum
        from training.checkpoints import latest_complete

        print(f"stopped; latest complete checkpoint: {latest_complete(run_dir)}\ncontinue with: make train "
              f"RESUME={run_dir}", flush=True)
    elif status == "FINISHED":
        print(summary(run_dir, config, time.time() - began), flush=True)
    print(f"run directory: {run_dir}", flush=True)
    return returncode


def header(mlflow_client, run_dir: Path, run_id: str, uri: str, layout: ParallelLayout) -> str:
    """What runs and where to look: the run directory, the MLflow run and how to open it, the rank logs."""
    try:
        experiment = mlflow_client.get_run(run_id).info.experiment_id
    except Exception:  # noqa: BLE001  (the header never costs the run)
        experiment = "?"
    where = "`make mlflow-ui`, then http://127.0.0.1:5000" if tracking.is_local(uri) else uri.rstrip("/")
    return (f"run {run_dir.name}: {run_dir}\n"
            f"  MLflow run {run_id}: {where}/#/experiments/{experiment}/runs/{run_id}\n"
            f"  the ranks' output (PaddleNLP's logs): {nodes.log_dir(run_dir, layout.nnodes)}/")


def summary(run_dir: Path, config: Config, seconds: float) -> str:
    """The end of a finished run: its eval loss, the best checkpoint, the time taken and the next commands."""
    from pipeline.console import duration
    from training.checkpoints import checkpoint_info, complete_checkpoints

    metric = config.export.metric
    rated = [(step, checkpoint_info(path)) for step, path in complete_checkpoints(run_dir)]
    rated = [(step, info) for step, info in rated if metric in info]
    lines = [f"finished in {duration(seconds)}"]
    if rated:
        step, last = rated[-1]
        best_step, best = min(rated, key=lambda item: item[1][metric])
        lines[0] += (f": {metric} {last[metric]:.4f} (perplexity {tracking.perplexity(last[metric]):.1f}) at step "
                     f"{step}; best {best[metric]:.4f} at step {best_step}: {best['path']}")
    lines += ["next: make export          # the best checkpoint -> parity-checked graph -> registered model version",
              "      make serve && make smoke   # serve the newest version, check it with real requests",
              "      make compare         # this run next to the others of the experiment"]
    return "\n".join(lines)


def _run_other_node(config: Config, layout: ParallelLayout, run_dir: Path, uri: str) -> int:
    """Node k > 0: wait for node 0's run directory and launch announcement, then run this node's ranks."""
    info = nodes.wait_for_launch(run_dir, config.to_yaml(), config.parallel.node_wait_s)
    resume_from = Path(info["resume_from"]) if info["resume_from"] else None
    pending = Path(info["pending_config"]) if info["pending_config"] else None
    print(f"node {nodes.node_rank()}: joining {run_dir}" + (f", resuming from {resume_from}" if resume_from else ""),
          flush=True)
    stopper = Stopper(config.training.stop_grace_s)
    stopper.install()
    print(f"node {nodes.node_rank()}: ranks' logs in {nodes.log_dir(run_dir, layout.nnodes)}; progress is shown on "
          f"node 0", flush=True)
    returncode = _run_launcher(launch_command(layout, run_dir, resume_from, pending),
                               worker_env(config, layout, uri, None), run_dir, nodes.log_dir(run_dir, layout.nnodes),
                               False, stopper)
    print(f"node {nodes.node_rank()}: ranks exited with code {returncode}; node 0 records the run's status "
          f"(run directory {run_dir})", flush=True)
    return 128 + stopper.signum if stopper.signum else returncode


def performance_text(config: Config, layout: ParallelLayout) -> str:
    """The performance settings as they will reach PaddleNLP (config.performance, translated by training/)."""
    from training.worker import performance_values

    values = performance_values(config, layout)
    default = PerformanceConfig()
    on = [k if v is True else f"{k}={v}" for k, v in vars(config.performance).items() if v != getattr(default, k)]
    lines = [f"performance settings: {', '.join(on) if on else 'none turned on'} (passed to PaddleNLP as:)"]
    for target, settings in values.items():
        lines.append(f"  {target}: " + ", ".join(f"{k}={v!r}" for k, v in settings.items()))
    return "\n".join(lines)


def pipeline_schedule_text(layout: ParallelLayout) -> str:
    """The dry run's schedule section: every schedule's bubble for this layout, and the chosen one's timeline."""
    from pipeline import schedules

    p, m, v = layout.pp, layout.accumulation_steps, layout.virtual_stages
    events = schedules.timeline(layout.pipeline_schedule, p, m, v)
    return (f"pipeline schedules for {p} stages x {m} micro-batches (forward 1, backward 2 time units; an interleaved "
            f"stage step is 1/v of that):\n{schedules.compare_text(p, m, v)}\n"
            f"timeline of {layout.pipeline_schedule}" + (f" over {v} virtual stages" if v > 1 else "")
            + f" (F/B: micro-batch forward/backward, f/b: later chunks, '.': idle; bubble "
            f"{schedules.idle_fraction(events):.3f}):\n{schedules.render_text(events)}")


def _report_stages(mlflow_client, run_id: str | None, run_dir: Path, layout: ParallelLayout) -> None:
    from pipeline import stage_report

    try:
        message = stage_report.report(mlflow_client, run_id, run_dir, layout)
    except Exception as exc:  # noqa: BLE001  (the advice must never cost the run its status)
        message = f"pipeline stage report failed: {exc.__class__.__name__}: {exc}"
    if message:
        print(message, flush=True)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _runs_root(config: Config) -> Path:
    return (REPO_ROOT / config.training.runs_dir).resolve()


def _claim_run_dir(config: Config) -> Path:
    """A new, empty run directory, claimed atomically (mkdir): runs started at the same moment never share one.
    Default names are `<config>-<UTC time>`, with `-2`, `-3`, ... when that second's name is taken."""
    root = _runs_root(config)
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


def _new_run_dir(config: Config) -> Path:
    """Create runs/<name>/ with the resolved config, tokenizer and packed data; nothing is left if this fails."""
    run_dir = _claim_run_dir(config)
    try:
        (run_dir / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
        from training.data import STATS_FILE, cache_entry, load_cached, prepare, store_cached

        t0 = time.time()
        data_dir, tokenizer_dir = run_dir / "data", run_dir / "tokenizer"
        entry = cache_entry(config)
        data = load_cached(entry, data_dir, tokenizer_dir) if entry else None
        cached = data is not None
        if not cached:
            import paddlenlp  # noqa: F401  (the tokenizer needs it; its import resets SIGTERM to the default action,
            stop_signal_handler()  # so re-arm: a SIGTERM during data preparation still removes the half-made run)
            from paddlenlp.utils.log import logger

            logger.set_level("WARNING")  # ("tokenizer config file saved in ...": the data line below says it all)

            data = prepare(config, data_dir, tokenizer_dir)
            (data_dir / STATS_FILE).write_text(json.dumps(asdict(data), indent=2))
            if entry:
                store_cached(entry, data_dir, tokenizer_dir)
        print(f"data: {data.train_documents} train / {data.validation_documents} validation documents -> "
              f"{data.train_blocks} / {data.validation_blocks} blocks of {config.training.seq_length} tokens; "
              f"vocabulary {data.vocab_size} (model {data.model_vocab_size}), validation unknown rate "
              f"{data.unknown_rate:.4f}; {time.time() - t0:.1f}s" + (f" (from the cache {entry})" if cached else ""),
              flush=True)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing half-written is left behind
        raise
    return run_dir


def _record_new_layout(mlflow_client, run_id: str, layout: ParallelLayout, resume_from: Path | None) -> None:
    """Params are immutable in MLflow: a resume on another layout is recorded in tags."""
    try:
        tags = mlflow_client.get_run(run_id).data.tags
        history = tags.get("pipeline.layout_history", tags.get(tracking.TAG_LAYOUT, "?"))
        step = resume_from.name.split("-")[-1] if resume_from else "0"
        mlflow_client.log_batch(run_id, tags=[
            _tag(tracking.TAG_LAYOUT, layout.name), _tag("pipeline.layout_history", f"{history} -> {layout.name}@{step}"),
            *[_tag(f"layout.{k}", str(v)) for k, v in layout.as_params().items()]])
    except Exception as exc:  # noqa: BLE001
        print(f"MLflow: could not record the new layout ({exc.__class__.__name__})", file=sys.stderr, flush=True)


def _tag(key: str, value: str):
    from mlflow.entities import RunTag

    return RunTag(key, value)


def _open_run(mlflow_client, config: Config, layout: ParallelLayout, run_dir: Path, uri: str) -> tuple[str, str]:
    """Create the MLflow run (or reopen the run directory's run on resume) and record what the run is.
    Returns the run id and the status it had before (None for a new run)."""
    info_file = run_dir / RUN_INFO
    liveness = {tracking.TAG_LAUNCHER: runs.launcher_id(), tracking.TAG_HEARTBEAT: str(int(time.time()))}
    # the math runtime of this launch (a resume may run on another machine): see pipeline/cpu_runtime.py
    liveness.update({f"runtime.{k}": v for k, v in cpu_runtime.describe(layout.threads_per_rank()).items()})
    if info_file.exists():
        run_id = json.loads(info_file.read_text())["run_id"]
        previous_status = mlflow_client.get_run(run_id).info.status
        mlflow_client.update_run(run_id, status="RUNNING")
        mlflow_client.log_batch(run_id, tags=[_tag(k, v) for k, v in liveness.items()])
        return run_id, previous_status
    from mlflow.entities import Param, RunTag

    experiment = tracking.experiment_id(mlflow_client, config.tracking.experiment, uri)
    tags = {
        "mlflow.runName": run_dir.name, tracking.TAG_RUN_DIR: str(run_dir), tracking.TAG_LAYOUT: layout.name,
        "git_commit": tracking.git_commit(), "paddle_version": _version("paddlepaddle", "paddlepaddle-gpu"),
        "paddlenlp_version": _version("paddlenlp"), "device": layout.device, "world_size": str(layout.world_size),
        **{f"layout.{k}": str(v) for k, v in layout.as_params().items()}, **liveness,
        **({"pipeline.sweep": config.tracking.sweep} if config.tracking.sweep else {}),
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
    return run_id, None


def _version(*distributions: str) -> str:
    """An installed package's version without importing it (importing paddlenlp would reset SIGTERM here)."""
    from importlib import metadata

    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def _close_run(mlflow_client, run_id: str, run_dir: Path, status: str, uri: str) -> None:
    from pipeline.compare import plot_run_losses

    try:
        sent = tracking.send_unsent(mlflow_client, run_id, run_dir)
        if sent:
            print(f"MLflow: sent {sent} records buffered during a tracking outage", flush=True)
        if status == "FINISHED":
            png = plot_run_losses(mlflow_client, run_id, run_dir / "loss_curve.png")
            mlflow_client.log_artifact(run_id, str(png))
        mlflow_client.set_terminated(run_id, status)
        print(f"MLflow run {run_id}: {status} (tracking URI {uri})", flush=True)
    except Exception as exc:  # noqa: BLE001  (tracking server gone: say so, keep the run directory)
        print(f"MLflow run {run_id}: could not record status {status} ({exc.__class__.__name__}); unsent metrics "
              f"stay in {run_dir}", file=sys.stderr, flush=True)


def _report_failure(mlflow_client, run_id: str | None, run_dir: Path, layout: ParallelLayout) -> None:
    paths = rank_logs(run_dir / "logs", layout.procs_per_node)
    logs = {rank: path.read_text(errors="replace") for rank, path in paths.items()}
    found = failing_rank(logs)
    if not found:
        print("training failed before any rank wrote a log", file=sys.stderr)
        return
    rank, why, tail = found
    print(f"\ntraining failed: rank {rank} {why}\nlast lines of {paths.get(rank, run_dir / 'logs')}:\n{tail}\n",
          file=sys.stderr, flush=True)
    kind, line = diagnose(run_dir, layout, rank, why, logs)
    if line:
        print(line, file=sys.stderr, flush=True)
    if run_id and mlflow_client:
        mlflow_client.log_text(run_id, tail, f"failure/workerlog.{rank}.tail.txt")
        mlflow_client.set_tag(run_id, "failed_rank", str(rank))
        if kind:
            mlflow_client.set_tag(run_id, "failure_kind", kind)


_DISK_FULL = re.compile(r"No space left on device|StorageFull|Errno 28|ENOSPC")
_OUT_OF_MEMORY = re.compile(r"Out of memory|out of memory|MemoryError|ResourceExhaustedError|Cannot allocate memory")


def diagnose(run_dir: Path, layout: ParallelLayout, rank: int, why: str, logs: dict[int, str]) -> tuple[str, str]:
    """(kind, one line with the next step) for the failures users hit most; ("", "") for anything else.

    Disk full: the partial checkpoints (newer than the latest complete one; the ranks are gone, so nothing writes
    them) are removed so the disk is not left full, and the line names the free space and the RESUME command."""
    from training.checkpoints import latest_complete, remove_partial

    latest = latest_complete(run_dir)
    usage = shutil.disk_usage(run_dir)
    needed = sum(p.stat().st_size for p in latest.rglob("*") if p.is_file()) if latest else 0
    # (the ranks' own words, or -- when the full disk kept them from being logged -- less room than a checkpoint)
    if any(_DISK_FULL.search(text) for text in logs.values()) or usage.free < needed:
        partial = remove_partial(run_dir)
        usage = shutil.disk_usage(run_dir)
        removed = f"removed the partial {', '.join(p.name for p in partial)}; " if partial else ""
        return "disk_full", (
            f"disk full: no space left on the file system of {run_dir} ({usage.free / 2**20:.0f} MiB free of "
            f"{usage.total / 2**30:.1f} GiB); {removed}latest complete checkpoint: {latest or 'none'}; free space "
            f"(or lower training.keep_checkpoints), then continue with: make train RESUME={run_dir}")
    text = logs.get(rank, "")
    if _OUT_OF_MEMORY.search(text):
        return "out_of_memory", (
            f"out of memory: rank {rank} of layout {layout.name} ({layout.device}) could not allocate; see the "
            f"estimate per device with `make plan CONFIG=<this config>` and lower parallel.micro_batch_size, turn on "
            f"parallel.recompute or raise the tensor/pipeline/sharding degrees")
    if why.startswith(("stopped without an error", "was lost by rank")):
        return "killed", (f"rank {rank} stopped without an error of its own: killed from outside (SIGKILL, often the "
                          f"kernel's out-of-memory killer: see `dmesg`; `make plan` estimates memory per device) or "
                          f"its node was lost; continue with: make train RESUME={run_dir}")
    return "", ""


def stop_signal_handler() -> None:
    """Until the ranks start, SIGTERM behaves like Ctrl-C (KeyboardInterrupt): what was half-made is removed."""
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
