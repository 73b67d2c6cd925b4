"""Object storage against a real S3 endpoint (SeaweedFS from .venv, started per module on a free port): complete
checkpoints reach the store in the background while training goes on, the store killed with SIGKILL mid-run and
restarted, and a run resumed by its MLflow run id on an empty disk (run directory and data cache gone) continues
with the uninterrupted run's losses; a data set published to the store and fetched by another machine. (Nodes that
share no disk: tests/integration/test_resume.py; a tracking server whose artifacts, exports included, live in the
store: tests/integration/test_remote.py.)"""
import json
import shutil
import signal
import subprocess
import sys

import pytest

from core import REPO_ROOT
from core.processes import descendants, signal_pids
from helpers import TINY_CONFIG, env_for, metric_history, progress_events, wait_until

pytestmark = pytest.mark.slow
MAX_STEPS = 150
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
    run = _train(s3, tmp_path / "node", uri, "cut", f"storage.uri={bucket}", f"data.cache_dir={bucket}/data",
                 f"data.local_dir={tmp_path / 'node' / 'disk' / 'cache'}")
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
        s3["state"] = s3["restart"]()  # the store is back: the queued checkpoints follow
        assert wait_until(lambda: max(_complete(store), default=0) >= 24, 120, 0.5, alive=run), _complete(store)
    finally:
        signal_pids([run.pid, *descendants(run.pid)], signal.SIGKILL)  # the node is lost ...
        run.wait(timeout=60)
    steps = _complete(store)
    assert max(steps) < MAX_STEPS, "the run ended before the node was lost: nothing left to resume"
    local = {p.relative_to(run_dir / "checkpoints" / f"checkpoint-{max(steps)}").as_posix()
             for p in (run_dir / "checkpoints" / f"checkpoint-{max(steps)}").rglob("*") if p.is_file()}
    prefix = f"{storage.checkpoints_prefix(store, 'cut')}/checkpoint-{max(steps)}/"
    assert {k[len(prefix):] for k in store.keys(prefix)} == {f for f in local if not f.startswith(".done-rank")}
    assert len(steps) <= 3  # (retention in the store: the newest 2 and the best)
    run_id = json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]
    shutil.rmtree(tmp_path / "node" / "disk")  # ... and its disk with it
    resumed = subprocess.run([sys.executable, "-m", "pipeline", "train", "--resume", run_id], cwd=REPO_ROOT,
                             env=_env(s3, uri), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"restored cut from {bucket}: checkpoint-{max(steps)}" in resumed.stdout
    assert f"from {bucket}/data (" in resumed.stdout and "data: fetched" in resumed.stdout  # (not prepared again)
    client = tracking.client(uri)
    expected = metric_history(client, _run_id(client, "ref"), "loss")
    got = metric_history(client, run_id, "loss")
    assert sorted(got) == sorted(expected) == list(range(1, MAX_STEPS + 1))
    bad = {s: (got[s], expected[s]) for s in expected if got[s] != pytest.approx(expected[s], rel=1e-6)}
    assert not bad, bad
    # a second resume on this machine finds its copy, though the run's record names the first machine's path
    from pipeline.runner import rundir
    client.set_tag(run_id, tracking.TAG_RUN_DIR, "/elsewhere/runs/cut")
    assert rundir.find(run_id, uri) == tmp_path / "node" / "disk" / "runs" / "cut"
    assert "store: every checkpoint is in" in resumed.stdout + "".join(
        e.get("text", "") for e in progress_events(tmp_path / "node" / "disk" / "runs" / "cut"))


def _complete(store) -> dict:
    from core import storage

    try:
        return storage.complete_steps(store, "cut")
    except Exception:  # noqa: BLE001  (the store is down)
        return {}


def _run_id(client, name: str) -> str:
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], f"attributes.run_name = '{name}'")
    return runs[0].info.run_id


def test_a_data_set_is_published_whole_and_fetched_once(s3, tmp_path, monkeypatch):
    """data.cache_dir=s3://...: a set prepared on one machine is published by content key, manifest last; a set
    whose manifest is missing in the store (a publish cut short) is never taken; another machine fetches the whole
    set into its local directory, byte for byte, and a second preparation there reuses that copy."""
    from core import dataset, storage
    from core.config import load_config, with_overrides
    from training.data.prepare import content_key, prepare
    from training.data.corpus import corpora

    for key, value in s3["env"].items():
        monkeypatch.setenv(key, value)
    (tmp_path / "t.yaml").write_text(TINY_CONFIG)
    uri = "s3://pipeline/data-tests"

    def machine(name):
        return with_overrides(load_config(tmp_path / "t.yaml"), [f"data.cache_dir={uri}",
                                                                 f"data.local_dir={tmp_path / name}"])
    first = prepare(machine("a"), log=print)
    key = content_key(machine("a"), corpora(machine("a").data))
    remote = storage.Store(uri)
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
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".")]  # (no staging left)
    assert prepare(machine("c"), log=lines.append).reused and sum("data: fetched" in line for line in lines) == 1

