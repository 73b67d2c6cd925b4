"""training/checkpoint/ is the one room for checkpoints: nothing outside it writes a completion marker or lists the
store's checkpoints; store failures are named by kind; the local writer lock names its holder and dies with it."""
import ast
import signal
import subprocess
import sys

import pytest

from core import REPO_ROOT
from core.errors import ConfigError

# What only the room may call: writing a completion marker, listing the store's checkpoints, retention there.
ROOM_ONLY = {"mark_complete", "mark_complete_in_store", "checkpoint_keys", "complete_steps", "complete_steps_retrying",
             "marker_key", "retain", "checkpoints_prefix", "part_key", "prune"}
SOURCES = ("core", "model", "training", "serving", "export", "pipeline", "bench")


def test_nothing_outside_the_room_writes_a_marker_or_lists_the_store():
    offenders = []
    for folder in SOURCES:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            relative = path.relative_to(REPO_ROOT).as_posix()
            if relative.startswith("training/checkpoint/"):
                continue
            tree = ast.parse(path.read_text(), relative)
            for node in ast.walk(tree):
                name = None
                if isinstance(node, ast.Call):
                    func = node.func
                    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                elif isinstance(node, ast.ImportFrom) and node.module and "checkpoint" in node.module:
                    name = next((a.name for a in node.names if a.name in ROOM_ONLY), None)
                elif isinstance(node, ast.Constant) and node.value == "checkpoint_complete.json":
                    name = "the marker's file name"
                if name in ROOM_ONLY or name == "the marker's file name":
                    offenders.append(f"{relative}:{node.lineno} {name}")
    assert not offenders, offenders


def _client_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")


@pytest.mark.parametrize("error, kind", [
    (lambda: _client_error("SignatureDoesNotMatch", 403), "auth"),
    (lambda: _client_error("InvalidAccessKeyId", 403), "auth"),
    (lambda: _client_error("AccessDenied", 403), "permission"),
    (lambda: _client_error("NoSuchBucket", 404), "no-bucket"),
    (lambda: _client_error("InternalError", 500), "unreachable"),
    (lambda: __import__("botocore.exceptions").exceptions.EndpointConnectionError(endpoint_url="http://x"),
     "unreachable"),
    (lambda: __import__("botocore.exceptions").exceptions.NoCredentialsError(), "auth"),
])
def test_store_failures_are_named_by_kind_never_auth_as_unreachable(error, kind):
    from core.storage import describe

    found, text = describe(error())
    assert found == kind, text
    assert "\n" not in text and (kind != "auth" or "credentials" in text)


def test_retrying_rides_an_outage_then_names_it_and_never_retries_a_refusal():
    from core.storage import Store, StoreError, retrying

    store = Store("s3://bucket/p", retry_s=1.2)
    calls = []

    def down():
        calls.append(1)
        raise ConnectionError("refused")

    with pytest.raises(StoreError, match=r"s3://bucket/p at .*: listing: unreachable .* for 1.2s \(storage.retry_s\)"):
        retrying(down, "listing", store)
    assert len(calls) >= 2  # (0.5 s, then 1 s would pass the deadline)
    refused = []

    def auth():
        refused.append(1)
        raise _client_error("SignatureDoesNotMatch", 403)

    with pytest.raises(StoreError, match="credentials were refused") as caught:
        retrying(auth, "listing", store)
    assert refused == [1] and caught.value.kind == "auth"
    flaky = iter([ConnectionError("x"), None])

    def back():
        if (e := next(flaky)) is not None:
            raise e
        return "ok"

    assert retrying(back, "listing", store) == "ok"


def test_the_local_writer_lock_names_its_holder_and_dies_with_it(tmp_path):
    from training.checkpoint.lease import LocalLock, gone, writer_id

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]);"
                               "from pathlib import Path; from training.checkpoint.lease import LocalLock, writer_id;"
                               "LocalLock(Path(sys.argv[2]), writer_id()); print('held', flush=True); time.sleep(60)",
                               str(REPO_ROOT), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"is being trained by pid {holder.pid} on "):
            LocalLock(tmp_path, writer_id())
        assert not gone(writer_id(holder.pid))
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        lock = LocalLock(tmp_path, writer_id())  # (the kernel released the dead holder's lock)
        lock.release()
    finally:
        if holder.poll() is None:
            holder.kill()
    assert gone(f"{writer_id().split(':')[0]}:{holder.pid}:12345")  # (its pid gone, or reused by another process)
    assert not gone(writer_id()) and not gone("another-host:1:1")
