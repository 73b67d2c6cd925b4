"""A real `mlflow server` as the only link between machines, keeping its artifacts in a real object store
(SeaweedFS, `--artifacts-destination s3://...`; the machines hold no store credentials): train -> export on "another
machine" (the training run directory is gone) -> serve `models:/<name>/<version>` from a clean directory -> one HTTP
request. And a registration that fails half-way publishes nothing."""
import json
import shutil

import pytest
import requests

from helpers import cli, free_port
from pipeline.runner import tracking_server
from core import tracking
from core.config import ConfigError
from core.processes import group_alive, port_in_use

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def remote(tmp_path_factory, s3):
    from helpers import TINY_CONFIG
    from pipeline.runner import seaweedfs as object_store

    root = tmp_path_factory.mktemp("remote")
    port = free_port()
    state_dir = root / "server"
    store, artifacts = root / "store" / "mlflow.db", "s3://mlflow-remote/artifacts"
    object_store.ensure_bucket(s3["state"], artifacts)
    state = tracking_server.start("127.0.0.1", port, store, artifacts, state_dir, store_env=s3["env"])
    config = root / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    yield {"root": root, "url": state["url"], "port": port, "state_dir": state_dir, "store": store,
           "artifacts": artifacts, "config": config, "s3": s3}
    tracking_server.stop(state_dir)
    assert not group_alive(state["pid"]) and not port_in_use(port), "tracking server left behind"


def test_train_here_export_there_serve_a_registered_version(remote):
    root, url = remote["root"], remote["url"]
    # machine A: train (checkpoint_artifacts defaults to `best`: improving checkpoints are uploaded)
    train_dir = root / "machine-a"
    proc = cli(["train", "--config", str(remote["config"]), f"training.runs_dir={train_dir}",
                "training.run_name=remote-run", "export.registered_model_name=remote-model"], url)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = json.loads((train_dir / "remote-run" / "mlflow_run.json").read_text())["run_id"]
    client = tracking.client(url)
    uploaded = {a.path for a in client.list_artifacts(run_id, "checkpoints")}
    assert "checkpoints/checkpoint-6" in uploaded and "checkpoints/checkpoint-6.json" in uploaded, uploaded
    # machine B: the run directory is not there; only the tracking server is shared
    shutil.rmtree(train_dir)
    export_root = root / "machine-b"
    proc = cli(["export", "--run-id", run_id, f"export.exports_dir={export_root / 'exports'}"], url)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "downloading checkpoints/checkpoint-6" in proc.stdout
    version = client.get_model_version("remote-model", "1")
    assert version.source == f"runs:/{run_id}/exports/remote-model/v1" and version.run_id == run_id
    exported = {a.path for a in client.list_artifacts(run_id, "exports/remote-model/v1")}
    assert {"exports/remote-model/v1/model.pdiparams", "exports/remote-model/v1/export.json"} <= exported
    with pytest.MonkeyPatch.context() as patch:  # (only this check reads the store directly)
        for key, value in remote["s3"]["env"].items():
            patch.setenv(key, value)
        from core.storage import Store
        keys = Store(remote["artifacts"]).keys("artifacts")
    assert any(k.endswith(f"{run_id}/artifacts/exports/remote-model/v1/model.pdiparams") for k in keys), \
        "the server keeps the export in the object store"
    # machine C: serve the registered version from a clean directory (downloads it)
    shutil.rmtree(export_root)
    overrides = [f"serving.http_port={free_port()}", f"serving.rpc_port={free_port()}",
                 f"training.runs_dir={root / 'machine-c' / 'runs'}", f"export.exports_dir={root / 'machine-c' / 'exports'}"]
    proc = cli(["serve", "--model", "models:/remote-model/1", *overrides], url)
    try:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "downloading 'remote-model' version 1" in proc.stdout
        served = root / "machine-c" / "exports" / "remote-model" / "1"
        assert json.loads((served / "export.json").read_text())["source_run_id"] == run_id
        state = json.loads((root / "machine-c" / "runs" / "serving" / "server.json").read_text())
        answer = requests.post(state["http_url"], data=json.dumps({"key": ["prompt"], "value": ["人工智能"]}),
                               timeout=30).json()
        fields = dict(zip(answer["key"], answer["value"]))
        assert answer["err_no"] == 0 and fields["model_name"] == "remote-model" and fields["model_version"] == "1"
        assert fields["source_run_id"] == run_id and len(json.loads(fields["token_ids"])) >= 1
    finally:
        stopped = cli(["stop", *overrides], url)
        assert stopped.returncode == 0
    # an alias resolves to the same version, already on this machine (no second download)
    from core import registry as models
    from core.config import load_config

    client.set_registered_model_alias("remote-model", "champion", "1")
    config = load_config(None, [f"export.exports_dir={root / 'machine-c' / 'exports'}", f"tracking.tracking_uri={url}"])
    assert models.resolve(config, "models:/remote-model@champion") == served
    with pytest.raises(ConfigError, match="'remote-model' @nobody is not in the registry"):
        models.resolve(config, "models:/remote-model@nobody")
    remote["run_id"] = run_id


def test_registration_failure_publishes_nothing(remote):
    """The tracking server is stopped between logging the export's artifacts and registering the version: no
    directory, no version, and the retry after it is back succeeds."""
    run_id = remote.get("run_id")
    if run_id is None:
        pytest.skip("needs the trained run of the previous test")
    client = tracking.client(remote["url"])
    before = len(client.search_model_versions("name='remote-model'"))
    export_root = remote["root"] / "machine-d"
    override = f"export.exports_dir={export_root / 'exports'}"
    code = (
        "import sys, pipeline\n"
        "from core.config import load_config\n"
        "from pipeline.runner import tracking_server\n"
        "from pathlib import Path\n"
        "from pipeline import export\n"
        "real = export.register\n"
        "def stop_then_register(*a, **k):\n"
        "    tracking_server.stop(Path(sys.argv[2]))  # the server goes away after the artifacts were logged\n"
        "    return real(*a, **k)\n"
        "export.register = stop_then_register\n"
        "try:\n"
        "    export.run(load_config(), run_id=sys.argv[1], overrides=[sys.argv[3]])\n"
        "except export.ExportError as exc:\n"
        "    print('error:', exc); sys.exit(2)\n")
    import subprocess
    import sys

    from helpers import env_for
    from core import REPO_ROOT
    env = {**env_for(remote["url"]), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    proc = subprocess.run([sys.executable, "-c", code, run_id, str(remote["state_dir"]), override],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "nothing was published" in proc.stdout
    assert not (export_root / "exports" / "remote-model").exists() or \
        not any(p.name.isdigit() for p in (export_root / "exports" / "remote-model").iterdir())
    tracking_server.start("127.0.0.1", remote["port"], remote["store"], remote["artifacts"], remote["state_dir"],
                          store_env=remote["s3"]["env"])
    assert len(client.search_model_versions("name='remote-model'")) == before
    retry = cli(["export", "--run-id", run_id, override], remote["url"])
    assert retry.returncode == 0, retry.stderr[-3000:]
    assert len(client.search_model_versions("name='remote-model'")) == before + 1
