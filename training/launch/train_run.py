"""A training run, as `make train` and `make finetune` start it: resolve -> prepare -> open -> launch -> close.

resolve  the layout and the run directory (a new one, or the one `--resume` names) and where the ranks start from
prepare  a new run directory with config, tokenizer and packed data; on resume, remove what an interruption left
open     the MLflow run (training/launch/tracked_run.py): created, or reopened on resume
launch   the ranks of this node (training/launch/ranks.py, supervise.py), progress on the console (console.py)
close    the status: FINISHED (all ranks exited 0), KILLED (interrupted: resumable from the latest complete checkpoint)
         or FAILED (the failing rank and why: training/launch/failures.py)

Multi-node: node 0 does all of it; the other nodes wait for node 0's announcement (training/launch/nodes.py) and
launch.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from core import arithmetic, tracking
from core.config import Config, ConfigError, PerformanceConfig, load_config
from core.layout import ParallelLayout
from training.launch import failures, nodes, rundir, supervise
from training.launch.ranks import Launch, Outcome, launch_ranks, run_other_node
from training.launch.tracked_run import TrackedRun
from training.checkpoint import in_store as checkpoint_store
from core import schedules
from core.storage import Store
from training.checkpoint import lease
from training.checkpoint.local import checkpoint_info, complete_checkpoints, latest_complete, remove_partial
from training.data import check_size_early
from training.launch import machine
from training.launch.console import duration
from training.rank import performance_values

# A resume's config waits here until the resumed run has completed a step (training/callbacks.py PromoteConfig).
PENDING_CONFIG = "config.next.yaml"
# A run that finished but whose checkpoints did not all reach the store (storage.uri): this exit code and this tag.
EXIT_STORE_MISSING = 4
TAG_STORE_MISSING = "pipeline.store_missing"


def run(config: Config, resume: str = "", dry_run: bool = False) -> int:
    launch = resolve(config, resume, dry_run)
    print(describe(launch), flush=True)
    if dry_run:
        return 0
    check_before_launch(launch)
    if nodes.node_rank() != 0:  # (the other nodes' launchers never touch the tracking store)
        return run_other_node(launch)
    tracked = TrackedRun(config).connect()
    stopper = supervise.Stopper(config.training.stop_grace_s)
    prepare(launch, stopper)
    stopper.install()  # (here: data preparation imported paddlenlp, which resets SIGTERM)
    try:
        tracked.open(launch.run_dir, launch.layout)
    except BaseException:
        launch.writer.release()
        raise
    print(header(launch, tracked), flush=True)
    began, outcome = time.time(), Outcome()
    try:
        outcome = launch_ranks(launch, tracked, stopper)
    finally:
        close(launch, tracked, outcome)
    missing = checkpoint_store.missing(launch.run_dir) if outcome.status == "FINISHED" else None
    if missing:  # (finished, but not every checkpoint is in the store: a scheduler sees it in the exit code)
        outcome.returncode = EXIT_STORE_MISSING
        print(f"store: {', '.join(missing['missing'])} did not reach {config.storage.uri} ({missing['reason']}); the "
              f"run finished, exit code {EXIT_STORE_MISSING}; MLflow tag {TAG_STORE_MISSING}", file=sys.stderr,
              flush=True)
    if stopper.signum:
        outcome.returncode = 128 + stopper.signum
        print(f"stopped; latest complete checkpoint: {_latest(launch.run_dir)}\ncontinue with: make train "
              f"RESUME={launch.run_dir}", flush=True)
    elif outcome.status == "FINISHED":
        print(summary(launch.run_dir, config, time.time() - began), flush=True)
    print(f"run directory: {launch.run_dir}", flush=True)
    return outcome.returncode


# -- resolve ----------------------------------------------------------------------------------------------------------
def resumed_config(resume: str, overrides: list[str]) -> Config:
    """`train --resume`: the run directory's recorded config with `overrides` on top (maybe another layout). A run id
    is looked up in the tracking store the overrides name (tracking.tracking_uri=...), else $MLFLOW_TRACKING_URI's,
    else the local one."""
    given = load_config(None, [o for o in overrides if o.split("=", 1)[0].startswith("tracking.")])
    run_dir = rundir.find(resume, tracking.tracking_uri(given.tracking))
    recorded = load_config(run_dir / "config.yaml")
    config = recorded.with_overrides(overrides)
    latest = _latest(run_dir)
    if "semi_auto" in (recorded.parallel.mode, config.parallel.mode) and latest:
        raise ConfigError(f"RESUME={resume}: parallel.mode=semi_auto checkpoints hold the model's weights but no "
                          "optimizer state, so that run cannot resume (training/semi_auto.py); start a new run "
                          f"with model.init_from={latest} instead")
    return config


def resolve(config: Config, resume: str, dry_run: bool = False) -> Launch:
    layout = config.layout()
    store = nodes.meeting_store(config.storage, config.parallel.nnodes)
    if not resume and store is not None and nodes.node_rank() == 0 and config.training.run_name and not dry_run:
        resume = _requeued(config, store)
    if not resume:
        return Launch(config, layout, None)
    run_dir = rundir.find(resume, tracking.tracking_uri(config.tracking))
    if store is not None and nodes.node_rank() == 0:  # (the nodes' disks differ: the store says what is complete)
        return Launch(config, layout, run_dir, _latest_in_store(store, run_dir, config), run_dir / PENDING_CONFIG)
    return Launch(config, layout, run_dir, _latest(run_dir), run_dir / PENDING_CONFIG)


def _latest_in_store(store, run_dir: Path, config: Config) -> Path | None:
    """Nodes that share no filesystem: the latest checkpoint complete in the store, made whole on this disk."""
    fetched = checkpoint_store.fetch_latest(store, run_dir)
    if fetched is None:
        return None
    checkpoint, size, seconds = fetched
    if size:
        print(f"{checkpoint.name}: the other nodes' parts from {store.uri} ({size / 2**20:.1f} MB in {seconds:.1f}s)",
              flush=True)
    return checkpoint


def _requeued(config: Config, store) -> str:
    """Node 0 of nodes that share no filesystem, started as a new run: a run of that name that node 0 began
    before (on another disk) continues, by its MLflow run id; "" for a new run."""
    run_dir = rundir.runs_root(config.training) / config.training.run_name
    run_id = "" if run_dir.exists() else nodes.recorded_run_id(store, run_dir)
    if run_id:
        print(f"{config.training.run_name}: begun before on another disk (MLflow run {run_id}); continuing it from "
              f"{config.storage.uri}", flush=True)
    return run_id


def check_before_launch(launch: Launch) -> None:
    if launch.layout.device == "gpu":  # (what `make doctor` says, before anything is written)
        problems = [c for c in machine.checks(launch.config) if not c.ok]
        if problems:
            raise ConfigError("; ".join(f"{c.name}: {c.text}" for c in problems) + " (make doctor)")
    f = launch.config.finetune
    if launch.config.fine_tuning and not launch.config.model.init_from:
        raise ConfigError("finetune.data: a fine-tuning run starts from a trained model; use make finetune (MODEL=...) "
                          "or set model.init_from")
    if launch.config.fine_tuning and f.data != "reviews" and not Path(f.data).expanduser().is_file():
        raise ConfigError(f"finetune.data={f.data}: no such file (DATA= takes reviews or a .jsonl file)")
    launch.layout.check_fits_machine()
    if not launch.config.fine_tuning:  # (fine-tuning reads its own examples: training/finetune/data.py)
        check_size_early(launch.config)  # (a step count at no scale: refused now, not after MLflow and paddle start)
    if launch.config.storage.uri:  # (endpoint, credentials, bucket and a write, before any training time)
        seconds = Store.of(launch.config.storage, attempts=1).check()
        print(f"store: {launch.config.storage.uri} answers, accepts the credentials and a write ({seconds:.2f}s)",
              flush=True)
    if launch.layout.nnodes > 1 and not os.environ.get("MASTER"):
        raise ConfigError("parallel.nnodes > 1: set MASTER=<host:port> of node 0 (and NODE_RANK) on every node")
    if launch.layout.nnodes > 1 and launch.run_dir is None and not launch.config.training.run_name:
        raise ConfigError("parallel.nnodes > 1: set training.run_name, the same on every node (e.g. "
                          "training.run_name=$SLURM_JOB_NAME-$SLURM_JOB_ID): it names the run directory on shared "
                          "storage where the nodes meet")


# -- prepare ----------------------------------------------------------------------------------------------------------
def prepare(launch: Launch, stopper: supervise.Stopper) -> None:
    """A new run directory, or a resumed one cleaned; either way held by this launch alone (one writer per run)."""
    def lost():  # (another launch holds the run now: these ranks must not write another checkpoint)
        stopper.kill()

    if launch.run_dir is None:
        launch.run_dir = rundir.create(launch.config)
        launch.writer = lease.hold(launch.run_dir, launch.config.storage, lost)
        return
    launch.writer = lease.hold(launch.run_dir, launch.config.storage, lost)

    (launch.run_dir / checkpoint_store.NOT_UPLOADED).unlink(missing_ok=True)
    for path in remove_partial(launch.run_dir):  # (a save the interruption cut short: it would be written again)
        print(f"removed the partial {path.name} left by the interrupted run", flush=True)
    print(f"resuming {launch.run_dir} from {launch.resume_from or 'the start (no complete checkpoint yet)'}",
          flush=True)


# -- close ------------------------------------------------------------------------------------------------------------
def close(launch: Launch, tracked: TrackedRun, outcome: Outcome) -> None:
    """Record how the launch ended. A resume that never completed a step leaves the run as it was (config.yaml, the
    MLflow run's status)."""
    run_dir, layout = launch.run_dir, launch.layout
    if layout.nnodes > 1:
        nodes.withdraw(run_dir, nodes.meeting_store(launch.config.storage, launch.config.parallel.nnodes))
    started = not launch.resumed or not launch.pending.exists()
    if not started:
        launch.pending.unlink(missing_ok=True)
        print(f"the resume did not complete a step; {run_dir / 'config.yaml'} and the MLflow run's status "
              f"({tracked.previous_status}) are unchanged", file=sys.stderr, flush=True)
    if outcome.status == "FAILED":
        failure = failures.explain(run_dir, layout)
        if failure and started:
            tracked.record_failure(failure)
    elif layout.pp > 1 and started:
        tracked.record_stages(run_dir, layout)
    if started:
        tracked.record_layout(layout, launch.resume_from)
    missing = checkpoint_store.missing(run_dir)
    if missing and outcome.status == "FINISHED":
        tracked.set_tag(TAG_STORE_MISSING, f"{', '.join(missing['missing'])}: {missing['reason']}")
    tracked.close(run_dir, outcome.status if started else tracked.previous_status)
    if launch.writer:
        launch.writer.release()


# -- what the console shows -------------------------------------------------------------------------------------------
def describe(launch: Launch) -> str:
    """The dry run: model size, layout, pipeline schedule, performance settings."""
    config, layout = launch.config, launch.layout
    params = arithmetic.parameters(config.model, config.tokenizer)
    parts = [f"model: {_count(params)} parameters (vocabulary <= {config.tokenizer.max_vocab_size}), about "
             f"{_count(params / (layout.tp * layout.pp))} per rank\n" + layout.describe()]
    if layout.pp > 1:
        parts.append(pipeline_schedule_text(layout))
    parts.append(performance_text(config, layout))
    return "\n".join(parts)


def header(launch: Launch, tracked: TrackedRun) -> str:
    """What runs and where to look: the run directory, the MLflow run and how to open it, the rank logs."""
    run_dir = launch.run_dir
    changed = ""
    if tracked.previous_layout not in (None, launch.layout.name):
        changed = f"\n  layout {tracked.previous_layout} -> {launch.layout.name} (resumed on another layout)"
    return (f"run {run_dir.name}: {run_dir}\n  MLflow run {tracked.run_id}: {tracked.web_link()}\n"
            f"  the ranks' output (PaddleNLP's logs): {nodes.log_dir(run_dir, launch.layout.nnodes)}/{changed}")


def summary(run_dir: Path, config: Config, seconds: float) -> str:
    """The end of a finished run: its eval loss, the best checkpoint, the time taken and the next commands."""
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


def performance_text(config: Config, layout: ParallelLayout) -> str:
    """The performance settings as they will reach PaddleNLP (config.performance, translated by training/)."""
    values = performance_values(config, layout)
    default = PerformanceConfig()
    on = [k if v is True else f"{k}={v}" for k, v in vars(config.performance).items() if v != getattr(default, k)]
    lines = [f"performance settings: {', '.join(on) if on else 'none turned on'} (passed to PaddleNLP as:)"]
    for target, settings in values.items():
        lines.append(f"  {target}: " + ", ".join(f"{k}={v!r}" for k, v in settings.items()))
    return "\n".join(lines)


def pipeline_schedule_text(layout: ParallelLayout) -> str:
    """The dry run's schedule section: every schedule's bubble for this layout, and the chosen one's timeline."""
    p, m, v = layout.pp, layout.accumulation_steps, layout.virtual_stages
    events = schedules.timeline(layout.pipeline_schedule, p, m, v)
    return (f"pipeline schedules for {p} stages x {m} micro-batches (forward 1, backward 2 time units; an interleaved "
            f"stage step is 1/v of that):\n{schedules.compare_text(p, m, v)}\n"
            f"timeline of {layout.pipeline_schedule}" + (f" over {v} virtual stages" if v > 1 else "")
            + f" (F/B: micro-batch forward/backward, f/b: later chunks, '.': idle; bubble "
            f"{schedules.idle_fraction(events):.3f}):\n{schedules.render_text(events)}")


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _latest(run_dir: Path) -> Path | None:
    return latest_complete(run_dir)
