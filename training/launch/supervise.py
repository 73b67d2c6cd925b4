"""Process supervision of one node's ranks: the launch command and environment, running them with their output in
the rank logs, forwarding a stop signal (Stopper).

The ranks run in their own session: signals reach them only through the Stopper, and they get SIGTERM if the
launcher dies (core/processes.py child_dies_with_parent).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from core import REPO_ROOT
from core.layout import ParallelLayout
from core.processes import child_dies_with_parent, descendants, signal_pids
from training.launch import nodes


def launch_command(layout: ParallelLayout, run_dir: Path, resume_from: Path | None,
                   pending_config: Path | None = None) -> list[str]:
    worker = ["--run-dir", str(run_dir)] + (["--resume-from", str(resume_from)] if resume_from else []) + \
        (["--pending-config", str(pending_config)] if pending_config else [])
    if layout.world_size == 1:
        return [sys.executable, "-m", "training.rank", *worker]
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(layout.procs_per_node),
           "--max_restart", "0", "--log_dir", str(nodes.log_dir(run_dir, layout.nnodes))]
    if layout.nnodes > 1:
        # Multi-node: every node runs the same `make train`, with MASTER=<host:port> and NODE_RANK set (`run` checks
        # MASTER before it opens anything).
        cmd += ["--nnodes", str(layout.nnodes), "--master", os.environ["MASTER"], "--rank",
                os.environ.get("NODE_RANK", "0")]
    if layout.device == "gpu":
        cmd += ["--devices", os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(layout.procs_per_node))))]
    return cmd + [str(REPO_ROOT / "training" / "rank.py"), *worker]


def worker_env(parallel, layout: ParallelLayout, uri: str, run_id: str | None) -> dict:
    """The ranks' environment (`parallel`: the config's section, for the collectives' timeout)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["MLFLOW_TRACKING_URI"] = uri
    env["PYTHONUNBUFFERED"] = "1"  # progress reaches the terminal and the rank logs as it happens
    env.setdefault("PPNLP_HOME", str(REPO_ROOT / "runs" / ".paddlenlp"))
    env.setdefault("GLOG_minloglevel", "2")  # Paddle's C++ INFO/WARNING lines ("New Executor is Running", ...)
    if run_id:
        env["PIPELINE_MLFLOW_RUN_ID"] = run_id
    # A tracking-server outage must not stall training in MLflow's own retry loop (7 retries with backoff by
    # default): fail fast, and the logger buffers and re-sends (training/metrics/mlflow_logger.py).
    env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    env.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    if layout.device == "cpu":
        # 1F1B on gloo deadlocks unless sends are synchronous (read by fleet at import time).
        env["PADDLE_P2P_SYNC_SEND"] = "1"
    # Bounded collectives: a dead peer must end the job, not hang it.
    env.setdefault("FLAGS_gloo_timeout_seconds", str(parallel.collective_timeout_s))
    env.setdefault("FLAGS_nccl_timeout", str(parallel.collective_timeout_s))
    return env


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


def run_ranks(cmd: list[str], env: dict, run_dir: Path, log_dir: Path, single: bool, stopper: Stopper,
                  on_start=lambda: None) -> int:
    """Run the ranks; their output (PaddleNLP's, Paddle's) goes to the logs under `log_dir`, not to the console:
    one process writes logs/workerlog.0 itself, paddle.distributed.launch writes workerlog.<rank> and its own
    output (which repeats rank 0's) to launcher.log. The console shows training/launch/console.py's progress instead."""
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


def stop_signal_handler() -> None:
    """Until the ranks start, SIGTERM behaves like Ctrl-C (KeyboardInterrupt): what was half-made is removed."""
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
