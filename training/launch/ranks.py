"""Running one node's ranks for `make train` (training/launch/train_run.py): what a launch is, the ranks started and
supervised (supervise.py) with progress on the console (console.py), and how they ended; nodes other than 0 join
node 0's launch (nodes.py)."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from core import tracking
from core.config import Config
from core.layout import ParallelLayout
from training.launch import console, nodes, rundir, supervise
from training.launch.tracked_run import TrackedRun
from training.checkpoint.local import STOPPED_MARKER


@dataclass
class Launch:
    """What this launch runs: the config, its layout, the run directory and where the ranks start from."""
    config: Config
    layout: ParallelLayout
    run_dir: Path | None  # None until a new run's directory is claimed (prepare)
    resume_from: Path | None = None  # the latest complete checkpoint of a resumed run
    pending: Path | None = None  # a resume's config, promoted to config.yaml once the run completed a step
    writer: object = None  # while this launch trains the run: its writer lock and lease (training/checkpoint/lease.py)

    @property
    def resumed(self) -> bool:
        return self.pending is not None


@dataclass
class Outcome:
    status: str = "FAILED"
    returncode: int = 1


# -- this node's ranks------------------------------------------------------------------------------------------------------
def launch_ranks(launch: Launch, tracked: TrackedRun, stopper: supervise.Stopper) -> Outcome:
    """Run this node's ranks to the end; the outcome says how they ended."""
    config, layout, run_dir = launch.config, launch.layout, launch.run_dir
    if launch.pending is not None:  # (the new config, maybe another layout, goes live after the first step)
        launch.pending.write_text(config.to_yaml(), encoding="utf-8")
    if layout.nnodes > 1:
        nodes.announce(run_dir, config.to_yaml(), launch.resume_from, launch.pending, nodes.meeting_store(config.storage, config.parallel.nnodes),
                       tracked.run_id)
    stopped = run_dir / STOPPED_MARKER
    stopped.unlink(missing_ok=True)
    if stopper.signum:  # a signal while the run was being opened: do not start the ranks at all
        return Outcome("KILLED", 1)
    progress = console.Progress(run_dir)

    def started():  # (threads start after the fork, so the child's preexec_fn never races one)
        progress.start()
        tracked.heartbeat.start()

    try:
        returncode = supervise.run_ranks(
            supervise.launch_command(layout, run_dir, launch.resume_from, launch.pending),
            supervise.worker_env(config.parallel, layout, tracked.uri, tracked.run_id), run_dir,
            nodes.log_dir(run_dir, layout.nnodes), layout.world_size == 1, stopper, started)
    finally:
        progress.stop()
    _ranks_stopped_directly(stopped, stopper, returncode)
    # KILLED: the launcher was signalled, or the ranks were and then all exited cleanly. A rank that failed after
    # agreeing to stop (its peer machine died mid-save, say) makes the run FAILED, with its log attached.
    return Outcome("KILLED" if stopper.signum else "FINISHED" if returncode == 0 else "FAILED", returncode)


def _ranks_stopped_directly(stopped: Path, stopper: supervise.Stopper, returncode: int) -> None:
    """The ranks themselves were signalled (not this launcher): they leave STOPPED_MARKER."""
    if not stopped.exists() or stopper.signum:
        return
    info = json.loads(stopped.read_text())
    if returncode == 0:
        print(f"the ranks were signalled directly and stopped early ({info}); the run is KILLED", file=sys.stderr,
              flush=True)
        stopper.signum = info["signal"]
    else:
        print(f"the ranks were signalled directly ({info}) but did not all stop cleanly (exit code {returncode}); "
              "the run is FAILED", file=sys.stderr, flush=True)


def run_other_node(launch: Launch) -> int:
    """Node k > 0: wait for node 0's run directory and launch announcement, then run this node's ranks."""
    config, layout = launch.config, launch.layout
    run_dir = launch.run_dir or rundir.runs_root(config.training) / config.training.run_name
    store = nodes.meeting_store(config.storage, config.parallel.nnodes)
    info = nodes.wait_for_launch(run_dir, config.to_yaml(), config.parallel.node_wait_s, store=store)
    if store is not None:  # (this node's own disk: its run directory made here, the checkpoint from the store)
        resume_from, pending = rundir.join_locally(config, run_dir, info, store)
    else:
        resume_from = Path(info["resume_from"]) if info["resume_from"] else None
        pending = Path(info["pending_config"]) if info["pending_config"] else None
    print(f"node {nodes.node_rank()}: joining {run_dir}" + (f", resuming from {resume_from}" if resume_from else ""),
          flush=True)
    stopper = supervise.Stopper(config.training.stop_grace_s)
    stopper.install()
    log_dir = nodes.log_dir(run_dir, layout.nnodes)
    print(f"node {nodes.node_rank()}: ranks' logs in {log_dir}; progress is shown on node 0", flush=True)
    returncode = supervise.run_ranks(supervise.launch_command(layout, run_dir, resume_from, pending),
                                     supervise.worker_env(config.parallel, layout, tracking.tracking_uri(config.tracking), None),
                                     run_dir, log_dir, False, stopper)
    print(f"node {nodes.node_rank()}: ranks exited with code {returncode}; node 0 records the run's status "
          f"(run directory {run_dir})", flush=True)
    return 128 + stopper.signum if stopper.signum else returncode
