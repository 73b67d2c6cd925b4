"""Graceful stop and resume, with real signals: SIGTERM to `make train`, resume on another layout (optimizer state
included), a resume that fails, a launcher killed with SIGKILL.

Every run here starts from the same saved weights and sees the same batches, so any layout's losses can be compared
with one uninterrupted single-process reference (layouts agree to ~1e-7; asserted 1e-4 relative)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import (LAYOUTS, env_for, make_command, metric_history, processes_matching, seeded_world,
                     wait_until)
from core import REPO_ROOT, tracking
from core.processes import descendants, signal_pids
from training.checkpoint import local as checkpoints
from training.checkpoint import in_store as checkpoint_store

pytestmark = pytest.mark.slow
RTOL = 1e-4
STEPS = 30  # long enough that a signal sent after the first checkpoint always lands mid-run
GRACE_S = 20


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    world = seeded_world(tmp_path_factory.mktemp("resume"))
    world["common"] = [f"training.runs_dir={world['runs']}", f"model.init_from={world['weights']}",
                       f"training.max_steps={STEPS}", f"training.stop_grace_s={GRACE_S}"]
    proc = _train(world, "reference")
    assert proc.wait(timeout=300) == 0
    world["reference"] = metric_history(tracking.client(world["uri"]), _run_id(world, "reference"), "loss")
    assert sorted(world["reference"]) == list(range(1, STEPS + 1))
    return world


def _train(world, name, *extra, make=False):
    """Start a training run in the background (through `make train` when asked, as a user would)."""
    if make:
        args = " ".join([*world["common"], f"training.run_name={name}", *extra])
        cmd = make_command("train", f"CONFIG={world['config']}", f"ARGS={args}")
    else:
        cmd = [sys.executable, "-m", "pipeline", "train", "--config", str(world["config"]), *world["common"],
               f"training.run_name={name}", *extra]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env_for(world["uri"]), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _resume(world, name, *overrides):
    return subprocess.run([sys.executable, "-m", "pipeline", "train", "--resume", str(world["runs"] / name),
                           *overrides], cwd=REPO_ROOT, env=env_for(world["uri"]), capture_output=True, text=True,
                          timeout=300)


def _run_id(world, name):
    return json.loads((world["runs"] / name / "mlflow_run.json").read_text())["run_id"]


def _wait_for_checkpoint(world, name, proc, step=3):
    marker = world["runs"] / name / "checkpoints" / f"checkpoint-{step}" / "checkpoint_complete.json"
    assert wait_until(marker.exists, 240, 0.05, alive=proc), "no first checkpoint in 240 s"


def _workers_of(run_dir: Path) -> list[int]:
    return processes_matching("training", str(run_dir))


def _stop_with(world, name, proc, sig=signal.SIGTERM, target=None):
    """Signal the run after its first checkpoint; returns (seconds to exit, output, stop step)."""
    _wait_for_checkpoint(world, name, proc)
    sent = time.time()
    os.kill(target or proc.pid, sig)
    output, _ = proc.communicate(timeout=GRACE_S + 60)
    elapsed = time.time() - sent
    latest = (world["runs"] / name / "checkpoints" / "latest").read_text().strip()
    return elapsed, output, int(latest.split("-")[1])


def _assert_losses_continue(world, name, stop_step):
    got = metric_history(tracking.client(world["uri"]), _run_id(world, name), "loss")
    after = list(range(stop_step + 1, STEPS + 1))
    assert sorted(got) == list(range(1, STEPS + 1))
    bad = {s: (got[s], world["reference"][s]) for s in after
           if got[s] != pytest.approx(world["reference"][s], rel=RTOL)}
    assert not bad, bad


def test_sigterm_to_make_train_saves_and_resumes_on_dp2(world):
    proc = _train(world, "stopped", make=True)
    elapsed, output, stop_step = _stop_with(world, "stopped", proc)
    run_dir = world["runs"] / "stopped"
    assert proc.returncode != 0 and elapsed < GRACE_S, (elapsed, output[-3000:])
    assert "SIGTERM: the ranks save a checkpoint after the current step and stop" in output
    assert 3 <= stop_step < STEPS, output[-2000:]
    log = (run_dir / "logs" / "workerlog.0").read_text(errors="replace")  # (PaddleNLP's lines: the rank log only)
    logged = [int(line.split("global_step: ")[1].split(",")[0]) for line in log.splitlines()
              if "loss: " in line and "global_step: " in line]
    assert max(logged) == stop_step, "the checkpoint is at the step where training stopped"
    assert "global_step: " not in output and "[   DEBUG]" not in output  # ... not the console
    assert not _workers_of(run_dir), "a rank outlived `make train`"
    client = tracking.client(world["uri"])
    run_id = _run_id(world, "stopped")
    assert client.get_run(run_id).info.status == "KILLED"
    refs = {a.path for a in client.list_artifacts(run_id, "checkpoints")}
    assert f"checkpoints/checkpoint-{stop_step}.json" in refs

    # a resume that fails (the checkpoint does not fit the model) changes nothing
    before = (run_dir / "config.yaml").read_text()
    failed = _resume(world, "stopped", "model.intermediate_size=96")
    assert failed.returncode != 0
    assert (run_dir / "config.yaml").read_text() == before and not (run_dir / "config.next.yaml").exists()
    assert client.get_run(run_id).info.status == "KILLED"

    # resume on two processes (data parallel): optimizer state and losses continue exactly
    resumed = _resume(world, "stopped", *LAYOUTS["dp2"])
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "layout single -> dp2" in resumed.stdout
    assert client.get_run(run_id).info.status == "FINISHED"
    from core.config import load_config

    assert load_config(run_dir / "config.yaml").parallel.data == 2  # the new layout is the run's config now
    assert client.get_run(run_id).data.tags["pipeline.layout"] == "dp2"
    _assert_losses_continue(world, "stopped", stop_step)


def test_tp2pp2_checkpoint_resumes_on_one_process(world):
    proc = _train(world, "tp2pp2", *LAYOUTS["tp2pp2"])
    elapsed, output, stop_step = _stop_with(world, "tp2pp2", proc)
    assert elapsed < GRACE_S and stop_step < STEPS, output[-3000:]
    assert not _workers_of(world["runs"] / "tp2pp2")
    # the stop step's checkpoint holds the state of all four ranks (two tensor shards x two stages)
    checkpoint = world["runs"] / "tp2pp2" / "checkpoints" / f"checkpoint-{stop_step}"
    assert len(list(checkpoint.glob("optimizer-*.safetensors"))) > 1
    resumed = _resume(world, "tp2pp2", "parallel.tensor=1", "parallel.pipeline=1", "parallel.micro_batch_size=8",
                      "parallel.accumulation_steps=1")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    _assert_losses_continue(world, "tp2pp2", stop_step)


def test_sigkill_of_the_launcher_leaves_no_orphan_the_run_is_reaped_and_resumes_exactly(world):
    proc = _train(world, "orphan")
    _wait_for_checkpoint(world, "orphan", proc)
    workers = descendants(proc.pid)
    assert workers
    os.kill(proc.pid, signal.SIGKILL)  # like a lost node or an OOM kill of the launcher
    proc.communicate(timeout=60)
    wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in workers), 60, 0.2)
    assert not _workers_of(world["runs"] / "orphan"), "the worker kept training without its launcher"
    client = tracking.client(world["uri"])
    run_id = _run_id(world, "orphan")
    assert client.get_run(run_id).info.status == "RUNNING"  # nobody could close it ...
    listed = subprocess.run([sys.executable, "-m", "pipeline", "runs", "--config", str(world["config"]), "--reap"],
                            cwd=REPO_ROOT, env=env_for(world["uri"]), capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "dead" in listed.stdout and "orphan" in listed.stdout
    run = client.get_run(run_id)  # ... until the reaper marked it
    assert run.info.status == "FAILED" and run.data.tags["pipeline.reaped"].startswith("dead: launcher process")

    # the worker saw its launcher die (SIGTERM from the kernel), saved a checkpoint and stopped; the same layout
    # resumes from it bit for bit
    stop_step = int((world["runs"] / "orphan" / "checkpoints" / "latest").read_text().split("-")[1])
    assert stop_step < STEPS
    resumed = _resume(world, "orphan")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert client.get_run(run_id).info.status == "FINISHED"
    got = metric_history(client, run_id, "loss")
    assert all(got[s] == pytest.approx(world["reference"][s], rel=1e-6, abs=1e-6) for s in range(stop_step + 1, STEPS + 1))


def test_a_signal_that_reaches_one_rank_stops_all_ranks_at_the_same_step(world):
    """As when a scheduler signals processes one by one: SIGTERM to rank 1 of a dp2 run only (not the launcher).
    The ranks agree to stop after the same step, the checkpoint is complete, and the run is KILLED, not FINISHED."""
    proc = _train(world, "one-rank", *LAYOUTS["dp2"])
    _wait_for_checkpoint(world, "one-rank", proc)
    run_dir = world["runs"] / "one-rank"
    rank1 = processes_matching("training", str(run_dir), "PADDLE_TRAINER_ID=1\0")[0]
    os.kill(rank1, signal.SIGTERM)
    output, _ = proc.communicate(timeout=GRACE_S + 60)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "the ranks were signalled directly and stopped early" in output
    stop_step = int((run_dir / "checkpoints" / "latest").read_text().split("-")[1])
    assert stop_step < STEPS
    log0, log1 = ((run_dir / "logs" / f"workerlog.{rank}").read_text(errors="replace") for rank in (0, 1))
    assert "[rank 1] SIGTERM" in log1 and "SIGTERM" not in log0  # only rank 1 was told ...
    logged = [int(line.split("global_step: ")[1].split(",")[0]) for line in log0.splitlines()
              if "global_step: " in line and "loss: " in line]
    assert max(logged) == stop_step  # ... and rank 0 stopped with it, at the checkpointed step
    assert tracking.client(world["uri"]).get_run(_run_id(world, "one-rank")).info.status == "KILLED"
    assert not _workers_of(run_dir)


# ---------------------------------------------------------------------------------------------------------------------
# Cluster runs: two `pipeline train` launchers on this machine act as two nodes (one dp rank each) sharing one
# training.runs_dir, as nodes share storage. A node is lost, the job is requeued on the one node left, stopped, and
# requeued on two nodes again: one run directory, one MLflow run, the losses of an uninterrupted run.

def _start_nodes(world, name: str, *extra, resume: bool = False, nnodes: int = 2) -> list[subprocess.Popen]:
    from helpers import free_port

    env = {**env_for(world["uri"]), "MASTER": f"127.0.0.1:{free_port()}"}
    what = ["--resume", str(world["runs"] / name)] if resume else \
        ["--config", str(world["config"]), *world["common"], f"training.run_name={name}"]
    layout = [f"parallel.nnodes={nnodes}", *LAYOUTS["dp2"]]
    return [subprocess.Popen([sys.executable, "-m", "pipeline", "train", *what, *layout, *extra], cwd=REPO_ROOT,
                             env={**env, "NODE_RANK": str(node)}, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
            for node in reversed(range(nnodes))]  # [node k, ..., node 0]: the others start first and wait


def _finish(procs, timeout: float) -> list[tuple[int, str]]:
    out = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        out.append((proc.returncode, output))
    return out


def test_node_lost_requeued_on_one_node_then_two_continues_the_same_run(world):
    run_dir, timeout_s = world["runs"] / "cluster", 10
    procs = _start_nodes(world, "cluster", f"parallel.collective_timeout_s={timeout_s}")
    try:
        _wait_for_checkpoint(world, "cluster", procs[1])
        # node 1 dies as a machine does: its rank and its launcher at once (leaves first: a launcher that outlived
        # its child by a moment would relay SIGTERM to it), so node 0 is left waiting in a collective
        killed_at = time.time()
        signal_pids([*reversed(descendants(procs[0].pid)), procs[0].pid], signal.SIGKILL)
        (_, out1), (rc0, out0) = _finish(procs, timeout=120)
        elapsed = time.time() - killed_at
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert rc0 != 0, out0[-2000:]
    # bounded by the collective timeout (plus the launcher's shutdown and the run's close), not by the test's wait
    assert elapsed < 4 * timeout_s + 20, elapsed
    client = tracking.client(world["uri"])
    run_id = _run_id(world, "cluster")
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and run.data.params["parallel.nnodes"] == "2"
    assert run.data.tags["world_size"] == "2"
    # one run directory (node 1 waited for node 0 to prepare it), one checkpoint directory per step holding every
    # rank's part, each node's logs in their own folder, each rank's memory record
    assert "node 1: waiting for node 0 to prepare" in out1 and f"node 1: joining {run_dir}" in out1
    assert [p.name for p in world["runs"].iterdir() if p.name.startswith("cluster")] == ["cluster"]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["node0", "node1"]
    assert "global_step: 3," in (run_dir / "logs" / "node1" / "workerlog.0").read_text()
    assert sorted(p.name for p in (run_dir / "memory").iterdir()) == ["rank0.json", "rank1.json"]
    first = int((run_dir / "checkpoints" / "latest").read_text().split("-")[1])
    assert (run_dir / "checkpoints" / f"checkpoint-{first}" / "rng_state_2.pth").is_file()
    assert not (run_dir / "launch.json").exists()

    # requeued on the one node left: the same run, from its latest complete checkpoint; stopped after one more
    (single,) = _start_nodes(world, "cluster", resume=True, nnodes=1)
    _wait_for_checkpoint(world, "cluster", single, step=first + 3)
    single.send_signal(signal.SIGTERM)
    ((rc, out),) = _finish([single], timeout=GRACE_S + 60)
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    assert f"resuming {run_dir} from {run_dir / 'checkpoints' / f'checkpoint-{first}'}" in out
    assert client.get_run(run_id).info.status == "KILLED"
    second = int((run_dir / "checkpoints" / "latest").read_text().split("-")[1])
    assert first < second < STEPS

    # requeued on two nodes again: node 1 joins the shared directory and both finish the run
    (rc1, out1), (rc0, out0) = _finish(_start_nodes(world, "cluster", resume=True), timeout=300)
    assert rc0 == 0 and rc1 == 0, out0[-3000:] + out1[-3000:]
    assert f"node 1: joining {run_dir}, resuming from {run_dir / 'checkpoints' / f'checkpoint-{second}'}" in out1
    assert client.get_run(run_id).info.status == "FINISHED"
    assert len(client.search_runs([client.get_run(run_id).info.experiment_id],
                                  "attributes.run_name = 'cluster'")) == 1
    _assert_losses_continue(world, "cluster", 0)


def _start_apart(world, s3, *extra, resume: bool = False) -> list[subprocess.Popen]:
    """Two nodes (one pipeline stage each) that share no filesystem: each its own runs_dir and data copy; they
    meet in the object store. Node 0
    requeued continues its own run directory (as deploy/train-node.sh does); node 1 always runs the first command."""
    from helpers import free_port

    env = {**env_for(world["uri"]), **s3["env"], "MASTER": f"127.0.0.1:{free_port()}"}
    procs = []
    for node in (1, 0):
        disk = world["root"] / f"disk{node}"
        what = ["--resume", str(disk / "runs" / "apart")] if resume and node == 0 else \
            ["--config", str(world["config"]), *world["common"], "training.run_name=apart"]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pipeline", "train", *what, f"training.runs_dir={disk / 'runs'}",
             f"data.local_dir={disk / 'data'}", "data.cache_dir=store",
             "storage.uri=s3://pipeline/apart", "storage.shared_filesystem=false", "parallel.nnodes=2",
             *LAYOUTS["pp2"], *extra], cwd=REPO_ROOT, env={**env, "NODE_RANK": str(node)}, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
    return procs  # [node 1, node 0]


def test_nodes_without_a_shared_disk_meet_in_the_store_and_a_lost_node_resumes_onto_an_empty_disk(world, s3,
                                                                                                    monkeypatch):
    from core import storage

    for key, value in s3["env"].items():
        monkeypatch.setenv(key, value)
    store = storage.Store("s3://pipeline/apart")
    procs = _start_apart(world, s3, "parallel.collective_timeout_s=10")
    try:
        assert wait_until(lambda: checkpoint_store.complete_steps(store, "apart"), 240, 0.2, alive=procs[1],
                          context=lambda: procs[1].stdout.read()[-3000:]), "no checkpoint complete in the store"
        signal_pids([*reversed(descendants(procs[0].pid)), procs[0].pid], signal.SIGKILL)  # node 1 is lost ...
        (_, _), (rc0, out0) = _finish(procs, timeout=120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert rc0 != 0, out0[-2000:]
    step = max(checkpoint_store.complete_steps(store, "apart"))
    assert step < STEPS
    shutil.rmtree(world["root"] / "disk1")  # ... with its disk: requeued onto an empty one
    procs = _start_apart(world, s3, "parallel.collective_timeout_s=10", resume=True)  # (the same command again)
    try:
        ((rc1, out1),) = _finish(procs[:1], timeout=300)
        assert rc1 == 0, out1[-3000:]
        ((rc0, out0),) = _finish(procs[1:], timeout=60)
        assert rc0 == 0, out0[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    node1 = world["root"] / "disk1" / "runs" / "apart"
    assert f"node 1: joining {node1}, resuming from {node1 / 'checkpoints' / f'checkpoint-{step}'}" in out1
    assert "data: fetched" in out1  # (its data copy from the store, not prepared again)
    # each node uploaded its own ranks' part (stage 1's weights are node 1's); the last checkpoint is whole only in
    # the store
    last = f"{checkpoint_store.checkpoints_prefix(store, 'apart')}/checkpoint-{STEPS}/"
    keys = {k[len(last):] for k in store.keys(last)}
    shards = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert {".parts/node-0.json", ".parts/node-1.json", "checkpoint_complete.json", *shards} <= keys, keys
    local = {p.name for p in (world["root"] / "disk0" / "runs" / "apart" / "checkpoints" / f"checkpoint-{STEPS}").iterdir()}
    assert local & shards == {"model-00001-of-00002.safetensors"}, local
    run_id = json.loads((world["root"] / "disk0" / "runs" / "apart" / "mlflow_run.json").read_text())["run_id"]
    got = metric_history(tracking.client(world["uri"]), run_id, "loss")
    assert sorted(got) == list(range(1, STEPS + 1))
    bad = {s: (got[s], world["reference"][s]) for s in got if got[s] != pytest.approx(world["reference"][s], rel=RTOL)}
    assert not bad, bad


def test_a_kill_during_an_async_save_resumes_from_the_last_complete_checkpoint(world):
    """training.async_checkpoint (the default): the writer thread is slowed (fault injection) so that saves are
    still in flight when the job is killed with SIGKILL. `latest` names a complete checkpoint, never the one being
    written; the resume removes the partial one and continues exactly."""
    from training.checkpoint.async_write import DELAY_ENV
    from training.checkpoint.local import COMPLETE_MARKER

    run_dir = world["runs"] / "async-kill"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "train", "--config", str(world["config"]),
                             *world["common"], "training.run_name=async-kill"], cwd=REPO_ROOT,
                            env={**env_for(world["uri"]), DELAY_ENV: "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)  # (a full pipe would stall training)
    try:
        _wait_for_checkpoint(world, "async-kill", proc)
        signal_pids([*reversed(descendants(proc.pid)), proc.pid], signal.SIGKILL)
        proc.wait(timeout=60)
        output = (run_dir / "logs" / "workerlog.0").read_text(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # (the newest complete checkpoint is what a resume takes; `latest` is renamed into place just after its marker, so
    # a kill between the two leaves it one checkpoint behind or absent, never pointing at an incomplete one)
    latest = checkpoints.latest_complete(run_dir).name
    pointer = run_dir / "checkpoints" / checkpoints.LATEST_FILE
    assert not pointer.exists() or (run_dir / "checkpoints" / pointer.read_text().strip() / COMPLETE_MARKER).is_file()
    stop_step = int(latest.split("-")[1])
    partial = [p for p in (run_dir / "checkpoints").glob("checkpoint-*") if not (p / COMPLETE_MARKER).exists()]
    assert partial and all(int(p.name.split("-")[1]) > stop_step for p in partial), output[-2000:]
    resumed = _resume(world, "async-kill")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert f"resuming {run_dir} from {run_dir / 'checkpoints' / latest}" in resumed.stdout
    assert f"removed the partial {min(partial, key=lambda p: int(p.name.split('-')[1])).name}" in resumed.stdout
    _assert_losses_continue(world, "async-kill", stop_step)
    # VisualDL: one curve per tag across the kill -- every step MLflow has, once, in order (training/metrics/visualdl_writers.py)
    from training.metrics import visualdl_layout

    logged = metric_history(tracking.client(world["uri"]), _run_id(world, "async-kill"), "loss")
    assert visualdl_layout.steps_in_order(run_dir / "visualdl" / "train", "train/loss") == sorted(logged)
    stalls = metric_history(tracking.client(world["uri"]), _run_id(world, "async-kill"), "checkpoint_stall_s")
    assert stalls and max(stalls.values()) < 1.0  # the 1 s-per-file writes never paused the loop


def test_the_first_loss_logged_after_a_resume_averages_the_same_steps(world):
    """Losses logged every 5 steps, checkpoints every 6: a kill -9 leaves a checkpoint inside a logging window. The
    resume continues that window (training/rank.py loss_window.json), so every logged loss, the first after the
    resume included, equals the uninterrupted run's (PaddleNLP alone logs the mean of the steps since the resume)."""
    window = ["training.max_steps=20", "training.logging_interval=5", "training.eval_interval=6",
              "training.save_interval=6"]
    assert _train(world, "window-ref", *window).wait(timeout=300) == 0
    reference = metric_history(tracking.client(world["uri"]), _run_id(world, "window-ref"), "loss")
    assert sorted(reference) == [5, 10, 15, 20]
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "train", "--config", str(world["config"]),
                             *world["common"], *window, "training.run_name=window-cut"], cwd=REPO_ROOT,
                            env=env_for(world["uri"]), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        _wait_for_checkpoint(world, "window-cut", proc, step=6)
        signal_pids([*reversed(descendants(proc.pid)), proc.pid], signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    latest = checkpoints.step_of(checkpoints.latest_complete(world["runs"] / "window-cut"))  # (see async-kill)
    assert latest % 5 != 0  # (6, 12 or 18: inside a window)
    resumed = _resume(world, "window-cut")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    got = metric_history(tracking.client(world["uri"]), _run_id(world, "window-cut"), "loss")
    bad = {s: (got.get(s), reference[s]) for s in reference
           if got.get(s) != pytest.approx(reference[s], rel=1e-6)}
    assert not bad, (latest, bad)
    from training.metrics import visualdl_layout  # (and VisualDL's curve: each logged step once, in order, the same values)

    logs = world["runs"] / "window-cut" / "visualdl" / "train"
    assert visualdl_layout.steps_in_order(logs, "train/loss") == [5, 10, 15, 20]
    assert visualdl_layout.read_scalars(logs)["train/loss"] == pytest.approx(reference, rel=1e-6)
