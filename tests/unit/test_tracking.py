"""Tracking logic without a server: buffered MLflow records in order, what a failure keeps, checkpoint upload
choice, run liveness, and where a local store keeps its artifacts. (Fast: no training, no server.)"""
import re
import time

import pytest

from training.launch import liveness

from core import tracking


class RecordingClient:
    """Records what would reach MLflow; fails the first `fail_calls` calls like an unreachable server."""

    def __init__(self, fail_calls=0):
        self.calls, self.fail_calls = [], fail_calls

    def _call(self, *entry):
        if self.fail_calls:
            self.fail_calls -= 1
            raise ConnectionError("server down")
        self.calls.append(entry)

    def log_batch(self, run_id, metrics=()):
        self._call("metrics", [(m.key, m.step) for m in metrics])

    def log_artifacts(self, run_id, local_dir, artifact_path):
        self._call("upload", artifact_path)

    def log_dict(self, run_id, info, path):
        self._call("record", path, info.get("artifact"))


def test_records_are_sent_in_order_and_kept_on_failure():
    pending = [tracking.metric_record("loss", 1.0, 1, 0), tracking.metric_record("loss", 0.9, 2, 0),
               tracking.checkpoint_record({"step": 2, "path": "/x/checkpoint-2"}, upload=True),
               tracking.metric_record("loss", 0.8, 3, 0),
               tracking.checkpoint_record({"step": 3, "path": "/x/checkpoint-3"}, upload=False)]
    client = RecordingClient(fail_calls=1)
    with pytest.raises(ConnectionError):
        tracking.send_records(client, "r", pending)
    assert len(pending) == 5 and client.calls == []  # nothing lost while the server is down
    tracking.send_records(client, "r", pending)
    assert pending == []
    assert client.calls == [
        ("metrics", [("loss", 1), ("loss", 2)]),
        ("upload", "checkpoints/checkpoint-2"),  # files first, then the record that points at them
        ("record", "checkpoints/checkpoint-2.json", "checkpoints/checkpoint-2"),
        ("metrics", [("loss", 3)]),
        ("record", "checkpoints/checkpoint-3.json", None),
    ]


def test_a_failure_mid_way_keeps_only_the_unsent_tail():
    pending = [tracking.metric_record("loss", 1.0, 1, 0),
               tracking.checkpoint_record({"step": 1, "path": "/x/checkpoint-1"}, upload=True)]
    client = RecordingClient()
    client.log_artifacts = lambda *a: (_ for _ in ()).throw(ConnectionError("gone during the upload"))
    with pytest.raises(ConnectionError):
        tracking.send_records(client, "r", pending)
    assert [r["kind"] for r in pending] == ["checkpoint"] and client.calls == [("metrics", [("loss", 1)])]


def test_unsent_records_survive_in_the_run_directory(tmp_path):
    pending = [tracking.metric_record("eval_loss", 2.5, 6, 1),
               tracking.checkpoint_record({"step": 6, "path": "/x/checkpoint-6", "eval_loss": 2.5}, upload=False)]
    tracking.save_unsent(tmp_path, pending)
    with pytest.raises(ConnectionError):
        tracking.send_unsent(RecordingClient(fail_calls=1), "r", tmp_path)
    assert (tmp_path / tracking.UNSENT_RECORDS).exists()  # still there for the next try
    client = RecordingClient()
    assert tracking.send_unsent(client, "r", tmp_path) == 2
    assert not (tmp_path / tracking.UNSENT_RECORDS).exists()
    assert client.calls == [("metrics", [("eval_loss", 6)]), ("record", "checkpoints/checkpoint-6.json", None)]


def test_checkpoint_upload_choice():
    from training.checkpoint.manager import should_upload

    earlier = [{"step": 3, "eval_loss": 5.0}, {"step": 6, "eval_loss": 4.0}, {"step": 7}]
    assert should_upload("best", "eval_loss", {"step": 9, "eval_loss": 3.9}, earlier)
    assert not should_upload("best", "eval_loss", {"step": 9, "eval_loss": 4.0}, earlier)  # ties are not better
    assert not should_upload("best", "eval_loss", {"step": 8}, earlier)  # a stop checkpoint has no eval metric
    assert should_upload("best", "eval_loss", {"step": 3, "eval_loss": 9.0}, [])  # the first rated one
    assert should_upload("all", "eval_loss", {"step": 8}, earlier)
    assert not should_upload("none", "eval_loss", {"step": 9, "eval_loss": 0.1}, earlier)


def test_run_liveness():
    me = liveness.launcher_id()
    host = me.split(":")[0]
    now = float(int(time.time()))
    beat = {tracking.TAG_HEARTBEAT: str(int(now - 10))}
    assert liveness.liveness({tracking.TAG_LAUNCHER: me, **beat}, now, 300)[0] == "alive"
    # this pid, but another start time: the pid was reused, the launcher is gone
    pid = me.split(":")[1]
    assert liveness.liveness({tracking.TAG_LAUNCHER: f"{host}:{pid}:1", **beat}, now, 300)[0] == "dead"
    assert liveness.liveness({tracking.TAG_LAUNCHER: f"{host}:999999999:5", **beat}, now, 300)[0] == "dead"
    # another host: only the heartbeat can tell
    other = {tracking.TAG_LAUNCHER: "elsewhere:1:1"}
    assert liveness.liveness({**other, tracking.TAG_HEARTBEAT: str(int(now - 10))}, now, 300)[0] == "alive"
    state, why = liveness.liveness({**other, tracking.TAG_HEARTBEAT: str(int(now - 400))}, now, 300)
    assert state == "stale" and "400s" in why


def test_a_local_store_keeps_its_artifacts_beside_its_database(tmp_path):
    """Tests and users with their own store never write into the repository's mlflow/artifacts."""
    assert tracking.local_artifact_root(f"sqlite:///{tmp_path / 'm.db'}") == tmp_path.resolve() / "artifacts"
    assert tracking.local_artifact_root(f"sqlite:///{tracking.LOCAL_STORE}") == tracking.LOCAL_ARTIFACTS


def test_a_dataset_insert_lost_to_a_run_started_at_the_same_moment_is_linked_on_the_next_try(tmp_path):
    """MLflow's SQL store races when two runs log the same new dataset at once (a sweep's first runs): the loser gets
    "UNIQUE constraint failed". Here the loser's first call fails that way; the run still ends with the input linked
    in a real store. Any other error is not retried."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.exceptions import MlflowException

    real = tracking.client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = real.create_run(real.create_experiment("race")).info.run_id
    dataset = DatasetInput(Dataset(name="data-abc", digest="abc", source_type="local", source="{}"),
                           [InputTag("mlflow.data.context", "training")])
    calls = []

    class Racing:
        def __init__(self, error):
            self.error = error

        def log_inputs(self, *args):
            calls.append(args[0])
            if len(calls) == 1:
                raise MlflowException(self.error)
            return real.log_inputs(*args)

    tracking.log_dataset_input(Racing("(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, "
                                      "datasets.name, datasets.digest"), run_id, dataset)
    assert calls == [run_id, run_id]
    assert [d.dataset.digest for d in real.get_run(run_id).inputs.dataset_inputs] == ["abc"]
    calls.clear()
    with pytest.raises(MlflowException, match="database is locked"):
        tracking.log_dataset_input(Racing("database is locked"), run_id, dataset)
    assert calls == [run_id]


def test_resume_by_run_id_searches_the_tracking_store_the_overrides_name(tmp_path, monkeypatch):
    """`make train RESUME=<id> ARGS="tracking.tracking_uri=..."` finds the run in that store, not the local one; an
    unknown id names the store searched (and never a password in its URI)."""
    from core.config import ConfigError, load_config
    from training.launch import train_run as train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    client = tracking.client(uri)
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(load_config(None, ["training.max_steps=70"]).to_yaml())
    run = client.create_run(client.create_experiment("e"), tags={tracking.TAG_RUN_DIR: str(run_dir)})
    config = train.resumed_config(run.info.run_id, [f"tracking.tracking_uri={uri}", "training.max_steps=90"])
    assert config.training.max_steps == 90 and config.tracking.tracking_uri == uri
    with pytest.raises(ConfigError, match=rf"not-a-run: neither a run directory nor a run id in the tracking store "
                                          rf"{re.escape(uri)} \(tracking"):
        train.resumed_config("not-a-run", [f"tracking.tracking_uri={uri}"])
    assert tracking.display_uri("http://team:s3cret@mlflow.internal:5000/x") == "http://team:***@mlflow.internal:5000/x"
