"""Object storage against a real S3 endpoint (SeaweedFS from .venv, started per module on a free port): complete
checkpoints reach the store in the background while training goes on, the store killed with SIGKILL mid-run and
restarted, and a run resumed by its MLflow run id on an empty disk (run directory and data cache gone) continues
with the uninterrupted run's losses; a data set published to the store and fetched by another machine. (Nodes that
share no disk: tests/integration/test_resume.py; a tracking server whose artifacts, exports included, live in the
store: tests/integration/test_remote.py.)"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from core import REPO_ROOT
from core.processes import descendants, signal_pids
from helpers import TINY_CONFIG, env_for, metric_history, progress_events, wait_until
from training.checkpoint import in_store as checkpoint_store

pytestmark = pytest.mark.slow
MAX_STEPS = 240  # (150 once ended, on a quiet machine, before the store caught up: nothing left to resume)
STEPS = [f"training.max_steps={MAX_STEPS}", "training.save_interval=6", "training.eval_interval=6", "training.logging_interval=1",
         "training.keep_checkpoints=2", "training.warmup_steps=2"]


def _env(s3, uri):
    return {**env_for(uri), **s3["env"]}


def _train(s3, tmp, uri, name, *extra):
    config = tmp / "t.yaml"
    tmp.mkdir(parents=True, exist_ok=True)
    config.write_text(TINY_CONFIG)
    return subprocess.Popen([sys.executable, "-m", "pipeline", "train", "--config", str(config), *STEPS,
                             f"training.runs_dir={tmp / 'disk' / 'runs'}", f"data.cache_dir={tmp / 'disk' / 'cache'}",
                             f"training.run_name={name}", *extra], cwd=REPO_ROOT, env=_env(s3, uri),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_checkpoints_outlive_the_store_failing_and_the_disk(s3, tmp_path, monkeypatch):
    from core import storage, tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ref = _train(s3, tmp_path / "ref", uri, "ref")
    assert ref.wait(timeout=300) == 0, ref.stdout.read()[-3000:]
    bucket = "s3://pipeline/tests"
    run = _train(s3, tmp_path / "node", uri, "cut", f"storage.uri={bucket}", "data.cache_dir=store",
                 f"data.local_dir={tmp_path / 'node' / 'disk' / 'cache'}", "storage.retry_s=3")
    for key, value in s3["env"].items():  # (this process reads the store too)
        monkeypatch.setenv(key, value)
    store = storage.Store(bucket, attempts=1)
    run_dir = tmp_path / "node" / "disk" / "runs" / "cut"
    try:
        assert wait_until(lambda: 6 in _complete(store), 180, 0.2, alive=run), "no checkpoint reached the store"
        signal_pids([s3["state"]["pid"], *descendants(s3["state"]["pid"])], signal.SIGKILL)  # the store dies
        assert wait_until(lambda: (run_dir / "checkpoints" / "checkpoint-24" / "checkpoint_complete.json").exists(),
                          180, 0.1, alive=run), "training did not go on without the store"
        assert any("unreachable" in e.get("text", "") for e in progress_events(run_dir)), progress_events(run_dir)
        _restart_with_the_node_paused(s3, run)  # the store is back: the queued checkpoints follow
        assert wait_until(lambda: max(_complete(store), default=0) >= 24, 120, 0.1, alive=run), _complete(store)
    finally:
        signal_pids([run.pid, *descendants(run.pid)], signal.SIGKILL)  # the node is lost ...
        run.wait(timeout=60)
    steps = _complete(store)
    assert max(steps) < MAX_STEPS, "the run ended before the node was lost: nothing left to resume"
    # a checkpoint complete in the store holds every file of the local one (the newest that this disk still keeps
    # whole: local retention may have removed an older one once it was uploaded, and the node may have been killed
    # while retention was removing one -- it unlinks the completion marker first, so a half-removed directory has
    # none: CI once compared the store with the two files left of one)
    both = max(s for s in steps if (run_dir / "checkpoints" / f"checkpoint-{s}" / "checkpoint_complete.json").is_file())
    local = {p.relative_to(run_dir / "checkpoints" / f"checkpoint-{both}").as_posix()
             for p in (run_dir / "checkpoints" / f"checkpoint-{both}").rglob("*") if p.is_file()}
    prefix = f"{checkpoint_store.checkpoints_prefix(store, 'cut')}/checkpoint-{both}/"
    assert {k[len(prefix):] for k in store.keys(prefix)} == {f for f in local if not f.startswith(".done-rank")}
    run_id = json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]
    shutil.rmtree(tmp_path / "node" / "disk")  # ... and its disk with it
    _resume_while_the_store_is_down(s3, uri, run_id, run_dir, bucket)
    s3["state"] = s3["restart"]()
    resumed = _resume_twice_at_once(s3, uri, run_id, run_dir)
    client = tracking.client(uri)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "answers, accepts the credentials and a write" in resumed.stdout
    assert f"restored cut from {bucket}: checkpoint-{max(steps)}" in resumed.stdout
    # retention in the store, read once the resumed run's uploads are done (its end waits for them; read at the kill,
    # one checkpoint may be marked complete with its retention not yet run): the newest 2 and the best
    assert len(_complete(store)) <= 3 and max(_complete(store)) == MAX_STEPS, _complete(store)
    assert f"from {bucket}/data (" in resumed.stdout and "data: fetched" in resumed.stdout  # (not prepared again)
    expected = metric_history(client, _run_id(client, "ref"), "loss")
    got = metric_history(client, run_id, "loss")
    assert sorted(got) == sorted(expected) == list(range(1, MAX_STEPS + 1))
    bad = {s: (got[s], expected[s]) for s in expected if got[s] != pytest.approx(expected[s], rel=1e-6)}
    assert not bad, bad
    # a second resume on this machine finds its copy, though the run's record names the first machine's path
    from training.launch import rundir
    client.set_tag(run_id, tracking.TAG_RUN_DIR, "/elsewhere/runs/cut")
    assert rundir.find(run_id, uri) == tmp_path / "node" / "disk" / "runs" / "cut"
    assert "store: every checkpoint is in" in resumed.stdout + "".join(
        e.get("text", "") for e in progress_events(tmp_path / "node" / "disk" / "runs" / "cut"))


def _restart_with_the_node_paused(s3, run) -> None:
    """The store started again while the node waits (SIGSTOP): on a fast machine the run once reached its last step,
    240, during the restart and the catch-up, leaving nothing to resume."""
    node = [run.pid, *descendants(run.pid)]
    signal_pids(node, signal.SIGSTOP)
    try:
        s3["state"] = s3["restart"]()
    finally:
        signal_pids(node, signal.SIGCONT)


def _resume_while_the_store_is_down(s3, uri: str, run_id: str, run_dir, bucket: str) -> None:
    """A requeue while the store is down: one line naming the store and the cause after storage.retry_s (3 s here),
    the MLflow run (RUNNING: its launcher was killed) marked FAILED and tagged, nothing left on the disk."""
    from core import tracking

    signal_pids([s3["state"]["pid"], *descendants(s3["state"]["pid"])], signal.SIGKILL)
    began = time.monotonic()
    down = subprocess.run([sys.executable, "-m", "pipeline", "train", "--resume", run_id], cwd=REPO_ROOT,
                          env=_env(s3, uri), capture_output=True, text=True, timeout=300)
    assert down.returncode == 2 and "Traceback" not in down.stderr, down.stderr[-3000:]
    (line,) = [text for text in down.stderr.splitlines() if text.startswith("error:")]
    assert f"{bucket}/data at http://127.0.0.1:" in line and "unreachable" in line and "for 3s (storage.retry_s)" in line, line
    assert time.monotonic() - began < 120 and not run_dir.exists()
    record = tracking.client(uri).get_run(run_id)
    assert record.info.status == "FAILED" and "unreachable" in record.data.tags["pipeline.resume_failed"]


def _resume_twice_at_once(s3, uri: str, run_id: str, run_dir) -> subprocess.CompletedProcess:
    """The requeue with the store back: the lease the killed launcher left is taken over at once (its process is
    gone); a second launch of the run while the first trains is refused in one line naming the holder."""
    resuming = subprocess.Popen([sys.executable, "-m", "pipeline", "train", "--resume", run_id], cwd=REPO_ROOT,
                                env=_env(s3, uri), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        assert wait_until(lambda: (run_dir / "writer.lock").exists() and (run_dir / "writer.lock").read_text(), 300,
                          0.2, alive=resuming), "the resume did not take the run"
        second = subprocess.run([sys.executable, "-m", "pipeline", "train", "--resume", run_id], cwd=REPO_ROOT,
                                env=_env(s3, uri), capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        assert f"cut is being trained by pid {resuming.pid} on " in second.stderr, second.stderr[-2000:]
        out, err = resuming.communicate(timeout=600)
    finally:
        if resuming.poll() is None:
            os.killpg(resuming.pid, signal.SIGKILL)
    resumed = subprocess.CompletedProcess(resuming.args, resuming.returncode, out, err)
    assert "writer lease: " in resumed.stdout and "that process is gone)" in resumed.stdout, resumed.stdout[-3000:]
    return resumed


def _complete(store) -> dict:
    try:
        return checkpoint_store.complete_steps(store, "cut")
    except Exception:  # noqa: BLE001  (the store is down)
        return {}


def _run_id(client, name: str) -> str:
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], f"attributes.run_name = '{name}'")
    return runs[0].info.run_id


def test_a_data_set_is_published_whole_and_fetched_once(s3, tmp_path, monkeypatch):
    """data.cache_dir=store: a set prepared on one machine is published by content key, manifest last; a set
    whose manifest is missing in the store (a publish cut short) is never taken; another machine fetches the whole
    set into its local directory, byte for byte, and a second preparation there reuses that copy."""
    from core import dataset, storage
    from core.config import load_config
    from training.data.prepare import content_key, prepare
    from training.data.corpus import corpora

    for key, value in s3["env"].items():
        monkeypatch.setenv(key, value)
    (tmp_path / "t.yaml").write_text(TINY_CONFIG)
    uri = "s3://pipeline/data-tests"

    def machine(name):
        return load_config(tmp_path / "t.yaml").with_overrides([f"storage.uri={uri}", "data.cache_dir=store",
                                                                 f"data.local_dir={tmp_path / name}"])
    first = prepare(machine("a"), log=print)
    key = content_key(machine("a"), corpora(machine("a").data))
    remote = storage.Store(f"{uri}/data")  # (data.cache_dir=store: the sets under <storage.uri>/data)
    assert not first.reused and remote.read(remote.key(key, dataset.MANIFEST)) == (first.path / "manifest.json").read_bytes()
    remote.delete([remote.key(key, dataset.MANIFEST)])  # (the store holds every shard but not the manifest)
    lines = []
    again = prepare(machine("b"), log=lines.append)
    assert not again.reused and not any("fetched" in line for line in lines), lines  # built, then published
    fetched = prepare(machine("c"), log=lines.append)
    assert fetched.reused and fetched.path == tmp_path / "c" / key and any("data: fetched" in line for line in lines)
    def files(path):
        return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    assert files(fetched.path) == files(again.path)  # (the set the store holds: b's publish, manifest included)
    assert {k: v for k, v in files(first.path).items() if k != "manifest.json"} == \
        {k: v for k, v in files(again.path).items() if k != "manifest.json"}  # (and a's shards, byte for byte)
    # (no staging left; the key's lock file stays: training/data/prepare.py)
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".") and p.suffix != ".lock"]
    assert prepare(machine("c"), log=lines.append).reused and sum("data: fetched" in line for line in lines) == 1



def test_a_store_that_cannot_be_used_is_refused_before_launch_in_one_line(s3, tmp_path):
    """Endpoint, credentials and bucket are checked before anything starts: a refused secret is named as refused
    credentials (not "unreachable"), a dead endpoint as unreachable; one line each, in seconds, nothing made."""
    from core.processes import free_port

    cases = {"the credentials were refused (SignatureDoesNotMatch": {"AWS_SECRET_ACCESS_KEY": "not-the-secret"},
             "unreachable (EndpointConnectionError": {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
                                                      "MLFLOW_S3_ENDPOINT_URL": ""}}
    for cause, env in cases.items():
        config = tmp_path / "t.yaml"
        config.write_text(TINY_CONFIG)
        began = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pipeline", "train", "--config", str(config),
                               "storage.uri=s3://pipeline/refused", f"training.runs_dir={tmp_path / 'runs'}"],
                              cwd=REPO_ROOT, env={**_env(s3, f"sqlite:///{tmp_path / 'm.db'}"), **env},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        (line,) = [text for text in proc.stderr.splitlines() if text.strip()]
        assert line.startswith("error: s3://pipeline/refused at http://127.0.0.1:") and cause in line, line
        assert time.monotonic() - began < 60 and not (tmp_path / "runs").exists()
        assert not (tmp_path / "m.db").exists()  # (refused before the tracking store was opened)


def test_checkpoints_that_never_reach_the_store_end_the_run_with_exit_4_and_a_tag(s3, tmp_path):
    """The store dies mid-run and stays down: the run finishes its steps, waits storage.upload_wait_s, names the
    checkpoints missing and their cause, and ends with exit code 4 and the MLflow tag pipeline.store_missing."""
    from core import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = _train(s3, tmp_path, uri, "gone", "storage.uri=s3://pipeline/gone", "storage.upload_wait_s=2",
                 "training.max_steps=24")
    run_dir = tmp_path / "disk" / "runs" / "gone"
    try:
        assert wait_until(lambda: (run_dir / "checkpoints" / "checkpoint-6" / "checkpoint_complete.json").exists(),
                          180, 0.1, alive=run), "no checkpoint"
        signal_pids([s3["state"]["pid"], *descendants(s3["state"]["pid"])], signal.SIGKILL)
        out, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        s3["state"] = s3["restart"]()
    assert run.returncode == 4, out[-3000:]
    client = tracking.client(uri)
    record = client.get_run(_run_id(client, "gone"))
    assert record.info.status == "FINISHED"
    missing = record.data.tags["pipeline.store_missing"]
    assert "checkpoint-24" in missing and "unreachable" in missing, missing
    assert "did not reach s3://pipeline/gone" in out and "exit code 4" in out, out[-2000:]


def test_the_writer_lease_has_one_holder_lapses_and_is_taken_over_once(s3, monkeypatch):
    """runs/<run>/writer.json on the real store: refused while its holder renews it, taken over once it lapses (of
    two takers at the same moment one wins), and the old holder, back, finds it lost and stops."""
    import threading

    from core.errors import ConfigError
    from core.storage import Store
    from training.checkpoint.lease import StoreLease, holds, lease_key, writer_id

    for key, value in s3["env"].items():
        monkeypatch.setenv(key, value)
    store = Store("s3://pipeline/lease", retry_s=2)
    store.ensure_bucket()
    # (an 8 s lease, renewed every 2.7 s: on a busy 2-core machine a renewal once came more than a 3 s lease late)
    old = StoreLease(store, "r", "elsewhere:11:1", 8)
    assert "writer.json" in old.acquire()
    for _ in range(3):  # (still held after more than one lease time)
        with pytest.raises(ConfigError, match=r"r is being trained by pid 11 on elsewhere .*renewed \ds ago"):
            StoreLease(store, "r", writer_id(), 8).acquire()
        time.sleep(3.5)
    old.done.set()  # (its host is lost: no more renewals)
    time.sleep(8.5)
    takers, outcomes = [StoreLease(store, "r", f"taker{i}:1:1", 8) for i in range(2)], []
    barrier = threading.Barrier(2)

    def take(lease):
        barrier.wait()
        try:
            outcomes.append((lease, lease.acquire()))
        except ConfigError as exc:
            outcomes.append((lease, exc))
    threads = [threading.Thread(target=take, args=(t,)) for t in takers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    won = [lease for lease, how in outcomes if isinstance(how, str)]
    assert len(won) == 1 and "taken over from pid 11 on elsewhere" in dict(outcomes)[won[0]], outcomes
    assert holds(store, "r", won[0].holder) and not holds(store, "r", old.holder)
    lost = threading.Event()
    old.on_lost, old.done = lost.set, threading.Event()
    threading.Thread(target=old._renew, daemon=True).start()  # (the old holder is back and renews)
    assert lost.wait(10)
    won[0].release()
    assert store.read(lease_key(store, "r")) is None
