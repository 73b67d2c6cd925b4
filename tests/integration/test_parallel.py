"""Hybrid parallel on CPU (gloo): every layout reproduces the single-process loss curve from the same weights and data.

Tolerance: 1e-4 relative per logged loss (the runs here agree to ~1e-7; reduction order is the only difference).
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import LAYOUTS, cli, env_for, metric_history, processes_matching, seeded_world, wait_for_event
from core import REPO_ROOT, tracking
pytestmark = pytest.mark.slow
RTOL = 1e-4


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return {**seeded_world(tmp_path_factory.mktemp("parallel")), "losses": {}}


def train(world, name: str, extra=()):
    runs = world["root"] / "runs"
    proc = cli(["train", "--config", str(world["config"]), f"training.runs_dir={runs}", f"training.run_name={name}",
                f"model.init_from={world['weights']}", *LAYOUTS[name], *extra], world["uri"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_id = json.loads((runs / name / "mlflow_run.json").read_text())["run_id"]
    client = tracking.client(world["uri"])
    return client.get_run(run_id), metric_history(client, run_id, "loss"), metric_history(client, run_id, "eval_loss")


@pytest.fixture(scope="module")
def single(world):
    return train(world, "single")


# (semi_auto: a 1x2 and a 2x2 [dp, mp] mesh; dp2-semi, the 2x1 mesh, is measured by `make bench`)
@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2", "pp2v2", "sharding1x2", "tp2pp2", "dp2tp2", "tp2-semi",
                                    "dp2tp2-semi", "tp2-fused"])
def test_layout_matches_single_process(world, single, layout):
    run, losses, evals = train(world, layout)
    _, ref_losses, ref_evals = single
    assert sorted(losses) == sorted(ref_losses) == list(range(1, 7))
    for step, ref in ref_losses.items():
        assert losses[step] == pytest.approx(ref, rel=RTOL), (step, losses[step], ref)
    for step, ref in ref_evals.items():
        assert evals[step] == pytest.approx(ref, rel=RTOL), (step, evals[step], ref)
    tags = run.data.tags
    expected_world = {"dp2": 2, "tp2": 2, "pp2": 2, "pp2v2": 2, "sharding1x2": 2, "tp2pp2": 4, "dp2tp2": 4,
                      "tp2-semi": 2, "dp2tp2-semi": 4, "tp2-fused": 2}[layout]
    assert tags["world_size"] == str(expected_world) and run.data.params["layout.world_size"] == str(expected_world)
    for key in ("layout.dp", "layout.tp", "layout.pp", "layout.bubble_fraction", "layout.schedule"):
        assert key in tags
    assert_runtime_applied(world["root"] / "runs" / layout, expected_world, tags)
    # VisualDL gets MLflow's numbers (training/metrics/visualdl_writers.py): the same loss at the same steps
    from training.metrics import visualdl_layout

    shown = visualdl_layout.read_scalars(world["root"] / "runs" / layout / "visualdl" / "train")
    assert shown["train/loss"] == pytest.approx(losses, rel=1e-6)
    assert shown["eval/loss"] == pytest.approx(evals, rel=1e-6)
    if "pp" in layout:
        assert_stage_report(world, run, layout)
    world["losses"][layout] = losses


def assert_stage_report(world, run, layout: str) -> None:
    """A pipeline run records Paddle's own order per stage (equal to core/schedules.py's), per-stage times in
    MLflow, the timeline PNG, and a split suggestion that covers every decoder layer."""
    stages = json.loads((world["root"] / "runs" / layout / "pipeline_parallel" / "stages.json").read_text())
    assert stages["order_matches_paddle"] is True
    assert [s["stage"] for s in stages["stages"]] == [0, 1]
    assert all(s["steps"] == 5 and s["forward_ms"] > 0 and s["backward_ms"] > 0 for s in stages["stages"])
    assert sum(stages["suggested_stage_layers"]) == 4
    # (p-1)/(m+p-1) with m = 2 micro-batches; interleaved (p-1)/(v*m+p-1) with m = 4, v = 2
    expected = {"pp2": ("1F1B", 1 / 3), "pp2v2": ("interleaved-1F1B", 1 / 9), "tp2pp2": ("1F1B", 1 / 3)}[layout]
    assert (stages["schedule"], stages["analytic_bubble"]) == (expected[0], pytest.approx(expected[1]))
    metrics = run.data.metrics
    for key in ("stage0_forward_ms", "stage1_backward_ms", "pipeline_measured_idle_fraction"):
        assert metrics[key] > 0
    client = tracking.client(world["uri"])
    assert {"pipeline_parallel/timeline.png", "pipeline_parallel/stages.json"} <= {
        f.path for f in client.list_artifacts(run.info.run_id, "pipeline_parallel")}
    assert_stage_charts(world["root"] / "runs" / layout, stages, client, run.info.run_id)


def assert_stage_charts(run_dir: Path, stages: dict, client, run_id: str) -> None:
    """VisualDL: one writer per stage with the same tags at the same steps (the stages are lines of one chart), whose
    per-step compute averages to the stage report's own figure (the advice and the charts share their numbers); the
    per-step imbalance in VisualDL and in MLflow alike."""
    from training.metrics import visualdl_layout

    from training.metrics.stage_timing import read

    logs = run_dir / "visualdl"
    per_stage = [visualdl_layout.read_scalars(logs / f"stage-{k}") for k in (0, 1)]
    assert sorted(p.name for p in logs.iterdir()) == ["pipeline_parallel", "stage-0", "stage-1", "train"]
    # (each stage's writer is its first replica, the lowest rank of the stage: its own timer's record)
    writers = [min((r for r in read(run_dir) if r["stage"] == k), key=lambda r: r["rank"]) for k in (0, 1)]
    for scalars, record in zip(per_stage, writers):
        assert set(scalars) == set(visualdl_layout.STAGE_TAGS) and sorted(scalars["stage/forward_ms"]) == list(range(2, 7))
        busy = [scalars["stage/forward_ms"][s] + scalars["stage/backward_ms"][s] for s in range(2, 7)]
        assert sum(busy) / len(busy) == pytest.approx(record["busy_ms_per_step"], rel=1e-4)
    imbalance = visualdl_layout.read_scalars(logs / "pipeline_parallel")[visualdl_layout.IMBALANCE_TAG]
    assert sorted(imbalance) == list(range(2, 7)) and all(v >= 1.0 for v in imbalance.values())
    assert metric_history(client, run_id, "stage_imbalance_by_step") == pytest.approx(imbalance, rel=1e-6)
    assert client.get_run(run_id).data.metrics["stage_imbalance"] == pytest.approx(stages["stage_imbalance"])


def assert_runtime_applied(run_dir: Path, processes: int, tags: dict) -> None:
    """Every rank (not only the launcher) runs with the CPU math settings: its share of the cores, MKL's AMD switch
    exactly on AMD CPUs (core/workarounds/cpu_runtime.py)."""
    from core.workarounds import cpu_runtime
    threads = str(max(1, cpu_runtime.available_cores() // processes))
    switch = "5" if cpu_runtime.cpu_vendor() == "AuthenticAMD" else "unset"
    for rank in range(processes):
        log = (run_dir / "logs" / f"workerlog.{rank}").read_text()
        line = next(l for l in log.splitlines() if l.startswith("cpu runtime: "))
        seen = dict(item.split("=", 1) for item in line[len("cpu runtime: "):].split())
        assert (seen["threads"], seen["mkl_debug_cpu_type"]) == (threads, switch), (rank, line)
    assert (tags["runtime.threads"], tags["runtime.mkl_debug_cpu_type"]) == (threads, switch)


@pytest.mark.parametrize("layout", ["tp2pp2", "dp2tp2-semi", "tp2-fused"])
def test_checkpoint_merges_into_a_single_model(world, layout):
    """The checkpoint of a 4-process run (manual: unified checkpoint; semi_auto: the gathered full tensors) loads
    into one LlamaForCausalLM whose validation loss equals the parallel model's final eval loss."""
    runs = world["root"] / "runs"
    if not (runs / layout / "checkpoints" / "latest").exists():
        train(world, layout)
    from training.checkpoint.local import checkpoint_info, latest_complete
    from training.data.read import validation_dataset
    from model.llama import load_merged

    import paddle

    checkpoint = latest_complete(runs / layout)
    model = load_merged(checkpoint)
    model.eval()
    blocks = validation_dataset(runs / layout / "data").blocks
    losses = []
    with paddle.no_grad():
        for batch in np.split(blocks, len(blocks) // 8):
            inputs, labels = paddle.to_tensor(batch[:, :-1]), paddle.to_tensor(batch[:, 1:])
            losses.append(float(model(inputs, labels=labels)[0]))
    merged_loss = float(np.mean(losses))
    parallel_loss = checkpoint_info(checkpoint)["eval_loss"]
    assert abs(merged_loss - parallel_loss) < 1e-5, (merged_loss, parallel_loss)
    if layout == "tp2-fused":  # exported unfused (PaddleNLP splits the fused weights): export's gate passes
        from core.config import load_config
        from export import gates

        from model.llama import is_fused

        assert is_fused(checkpoint) and not model.config.fuse_attention_qkv
        error = gates.fused_weights_gate(model, checkpoint, load_config(runs / layout / "config.yaml"))
        assert error is not None and error < 1e-5


def test_a_tp2pp2_run_exports_like_its_merged_model(world):
    """`make export` of a run trained with tensor x pipeline parallel (4 ranks): the export's graph computes what
    the merged checkpoint computes (the run trained above; its config names a layout export must not need)."""
    runs = world["root"] / "runs"
    if not (runs / "tp2pp2" / "checkpoints" / "latest").exists():
        train(world, "tp2pp2")
    run_id = json.loads((runs / "tp2pp2" / "mlflow_run.json").read_text())["run_id"]
    proc = cli(["export", "--run-id", run_id, f"export.exports_dir={world['root'] / 'exports'}",
                "export.registered_model_name=parallel-model"], world["uri"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    export_dir = world["root"] / "exports" / "parallel-model" / "1"
    meta = json.loads((export_dir / "export.json").read_text())
    assert meta["source_run_id"] == run_id and Path(meta["checkpoint"]).parent.parent == runs / "tp2pp2"
    from serving.engine.runtime import create_predictor, predict
    from model.llama import load_merged

    import paddle

    model = load_merged(meta["checkpoint"])
    model.eval()
    ids = np.random.RandomState(0).randint(5, meta["vocab_size"], size=(3, 32)).astype("int64")
    with paddle.no_grad():
        expected = model(paddle.to_tensor(ids), use_cache=False, return_dict=False)[0].numpy()
    assert np.abs(predict(create_predictor(export_dir), ids) - expected).max() < 1e-4


# measured peak / `make plan`'s estimate must lie in this band, for every layout the plan models (manual mode).
# Seen on this CPU: 0.71 (pp2 with a [3,1] split: the plan assumes even stages and adds the first stage's
# activations to the last stage's logits, an upper bound) to 1.02 (tp2, where the gathered logits dominate).
MEMORY_BAND = (0.65, 1.10)


def test_plan_memory_estimate_matches_the_measured_peak(world):
    """`make plan`'s per-device memory model against each rank's measured peak tensor memory over the first step
    (training/metrics/mlflow_logger.py PeakMemory); the most loaded rank is what the plan estimates."""
    from pipeline import plan
    from core.config import load_config
    from core.layout import ParallelLayout

    runs = world["root"] / "runs"
    vocab = json.loads((world["weights"] / "config.json").read_text())["vocab_size"]
    ratios = {}
    for layout in ("single", "dp2", "tp2", "pp2", "pp2v2", "sharding1x2", "tp2pp2", "dp2tp2"):
        if not (runs / layout / "memory").exists():
            train(world, layout)
        config = load_config(world["config"], [*LAYOUTS[layout], f"tokenizer.max_vocab_size={vocab}"])
        estimate = plan.memory(config, config.layout())["total"]
        world_size = config.layout().world_size
        records = [json.loads(p.read_text()) for p in sorted((runs / layout / "memory").glob("rank*.json"))]
        assert sorted(r["rank"] for r in records) == list(range(world_size)) and all(r["step"] == 1 for r in records)
        ratios[layout] = max(r["peak_allocated_bytes"] for r in records) / estimate
    print("measured peak / plan estimate:", {k: round(v, 2) for k, v in ratios.items()})
    assert all(MEMORY_BAND[0] <= r <= MEMORY_BAND[1] for r in ratios.values()), ratios


def test_a_killed_rank_fails_the_job(world):
    """SIGKILL one rank mid-run: the job exits non-zero within a time bounded by the collective timeout (without it,
    the surviving rank waits in its all-reduce forever), names the rank, run is FAILED."""
    runs, timeout_s = world["root"] / "runs", 10
    cmd = [sys.executable, "-m", "pipeline", "train", "--config", str(world["config"]), f"training.runs_dir={runs}",
           "training.run_name=victim", *LAYOUTS["dp2"], "training.max_steps=5000", "training.eval_interval=5000",
           "training.save_interval=5000", f"parallel.collective_timeout_s={timeout_s}"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env_for(world["uri"]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_event(runs / "victim", lambda e: e["kind"] == "log" and e["step"] >= 2, proc, "step 2")
        victim, = processes_matching("training/rank.py", str(runs / "victim"), "PADDLE_TRAINER_ID=1\0")
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=30 * timeout_s)  # (a hang: caught here)
        elapsed = time.time() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "training failed: rank 1" in stderr, stderr[-2000:]
    assert "rank 1 stopped without an error of its own: killed from outside" in stderr and f"RESUME={runs / 'victim'}" in stderr
    # the timeout, then the launcher's clean-up and the report: a few timeouts' worth on a loaded machine, never 30
    assert elapsed < 6 * timeout_s, elapsed
    run_id = json.loads((runs / "victim" / "mlflow_run.json").read_text())["run_id"]
    client = tracking.client(world["uri"])
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags["failed_rank"] == "1"
    assert run.data.tags["failure_kind"] == "killed"
    assert [a.path for a in client.list_artifacts(run_id, "failure")] == ["failure/workerlog.1.tail.txt"]


# ---------------------------------------------------------------------------------------------------------------------
# Multi-node: two `pipeline train` launchers on this machine acting as two nodes sharing one training.runs_dir
# (losses equal to one process, a lost node, the requeue on one node and on two: tests/integration/test_resume.py).

def test_a_node_without_the_shared_directory_fails_with_the_path(world):
    """Storage that is not shared: node 1 never sees node 0's run directory and says so (bounded wait)."""
    from helpers import free_port

    proc = subprocess.run([sys.executable, "-m", "pipeline", "train", "--config", str(world["config"]),
                           f"training.runs_dir={world['root'] / 'not-shared'}", "training.run_name=alone",
                           "parallel.nnodes=2", "parallel.node_wait_s=2", *LAYOUTS["dp2"]], cwd=REPO_ROOT,
                          env={**env_for(world["uri"]), "MASTER": f"127.0.0.1:{free_port()}", "NODE_RANK": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"node 1: node 0 did not prepare {world['root'] / 'not-shared' / 'alone' / 'launch.json'}" in proc.stderr
    assert "shared storage" in proc.stderr
