"""The test pyramid: tests/unit/ (logic, no training or servers: `make test-fast`, under a minute) and
tests/integration/ (real training launches, real MLflow stores and servers, real Paddle Serving: marked `slow`).

Tests never write into the repository or the user's home: the whole session gets a home of its own (data cache,
PaddleNLP's home, matplotlib's config), and every MLflow store is a temporary one with its artifacts beside it.
"""
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
_HOME = tempfile.mkdtemp(prefix="pipeline-tests-home-")
os.environ.update(HOME=_HOME, XDG_CACHE_HOME=os.path.join(_HOME, ".cache"), PPNLP_HOME=os.path.join(_HOME, ".paddlenlp"),
                  MPLCONFIGDIR=os.path.join(_HOME, ".config", "matplotlib"))
os.environ.pop("MLFLOW_TRACKING_URI", None)  # (each test names its own store)
import core  # noqa: E402,F401  (zlib before paddle, for every test)
import pytest  # noqa: E402

from helpers import TINY_CONFIG  # noqa: E402

INTEGRATION = Path(__file__).resolve().parent / "integration"


# The modules that use the session's trained model (the `trained` / `exported` fixtures below). Under pytest-xdist they
# share one worker: the model is built once and its registry changes in one order.
SHARED_MODEL_MODULES = {"test_evaluate", "test_export", "test_finetune", "test_gateway", "test_generate",
                        "test_serving", "test_serving_faults"}


def pytest_collection_modifyitems(items):
    for item in items:
        if INTEGRATION in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slow)
        if "trained" in getattr(item, "fixturenames", ()) and Path(str(item.fspath)).stem not in SHARED_MODEL_MODULES:
            raise pytest.UsageError(f"{item.nodeid} uses the session's trained model: add its module to "
                                    f"SHARED_MODEL_MODULES in tests/conftest.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers: much of an integration test waits on processes, servers and I/O.
    A module stays on one worker (its module-scoped world is built once); the modules of the shared model go together.
    (xdist's own `loadgroup` cannot do it on this pytest: it renames items through an attribute pytest 9.2 ignores.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "shared model" if Path(module).stem in SHARED_MODEL_MODULES else module

    return ByModule(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked `alone` has the machine to itself; the others may run side by side. Held over the whole
    protocol, so a module's fixtures built in its first test's set-up count too. The xdist workers share flock(2)
    locks in the run's temporary root; a gate taken first keeps a waiting `alone` test from starving."""
    import fcntl

    base = item.config._tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    alone = item.get_closest_marker("alone") is not None
    with open(root / "machine.gate", "a") as gate, open(root / "machine.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        return (yield)


@pytest.fixture
def store_uri(tmp_path) -> str:
    """A fresh SQLite MLflow store for one test."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    path = tmp_path / "tiny-test.yaml"
    path.write_text(TINY_CONFIG + "\n# runs of this test go under its temporary directory\n")
    return path


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real S3 endpoint (SeaweedFS from .venv, pipeline/runner/seaweedfs.py) on a free port, per module."""
    from core.processes import free_port
    from pipeline.runner import seaweedfs as object_store

    root = tmp_path_factory.mktemp("s3")
    port = free_port()
    state = object_store.start(root / "store", port)
    yield {"root": root, "port": port, "state": state, "env": object_store.environment(state),
           "restart": lambda: object_store.start(root / "store", port)}
    object_store.stop(root / "store")


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """One short real training run (single process) in its own MLflow store, shared by export and serving tests."""
    from helpers import cli, free_port  # noqa: F401

    root = tmp_path_factory.mktemp("trained")
    config = root / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    common = [f"training.runs_dir={root / 'runs'}", f"export.exports_dir={root / 'exports'}",
              "export.registered_model_name=test-model", "training.max_steps=12", "training.eval_interval=6",
              "training.save_interval=6"]
    proc = cli(["train", "--config", str(config), "training.run_name=base", *common], uri)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"root": root, "config": config, "uri": uri, "overrides": common, "run_dir": root / "runs" / "base"}


@pytest.fixture(scope="session")
def exported(trained):
    from helpers import cli

    proc = cli(["export", "--config", str(trained["config"]), "--experiment", "tests"], trained["uri"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    export_dir = trained["root"] / "exports" / "test-model" / "1"
    assert (export_dir / "export.json").is_file()
    return {**trained, "export_dir": export_dir, "export_stdout": proc.stdout}


STRAYS = ("mlruns", "PipelineServingLogs", "ProcessInfo.json", "reports", "exports", "runs")
_PRESENT_AT_START = {name for name in STRAYS if (Path(__file__).resolve().parent.parent / name).exists()}


def pytest_sessionfinish(session):
    """Nothing generated lands in the repository: a test that wrote there fails the session (MLflow's default
    ./mlruns, serving's PipelineServingLogs, the verbs' default reports/, exports/, runs/ ...). The session's home
    goes away with it."""
    import shutil

    from core import REPO_ROOT

    shutil.rmtree(_HOME, ignore_errors=True)
    strays = [name for name in STRAYS if (REPO_ROOT / name).exists() and name not in _PRESENT_AT_START]
    if strays and session.exitstatus == 0:
        print(f"\ntests wrote into the repository: {', '.join(strays)}")
        session.exitstatus = 1
