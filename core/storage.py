"""The object store (`storage.uri` = s3://bucket/prefix): any S3 endpoint, through boto3.

Endpoint and credentials come from the standard environment that boto3 and MLflow read: AWS_ENDPOINT_URL (or
MLFLOW_S3_ENDPOINT_URL), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION. boto3 rather than MLflow's
artifact repository because a checkpoint needs what that repository does not offer: a conditional write (the
completion marker, written last with If-None-Match, so two writers never both publish one and a reader never takes
a partial checkpoint), listing by prefix and deleting (retention).

Layout (docs/storage.md):
    <prefix>/runs/<run name>/checkpoints/checkpoint-<step>/<the checkpoint's files>
                                                           .parts/node-<k>.json       (nodes without a shared disk)
                                                           checkpoint_complete.json   (last)
    <prefix>/runs/<run name>/launch.json, run.json        (nodes without a shared disk: where they meet)
"""
from __future__ import annotations

import os
from pathlib import Path

from core.errors import ConfigError

COMPLETE_MARKER = "checkpoint_complete.json"  # (a complete checkpoint's record, on disk as in the store)
PARTS_DIR = ".parts"  # (in the store: one record per node whose part of the checkpoint is uploaded)
ABSENT = ("NoSuchKey", "404", "NoSuchBucket")  # (error codes of a read of nothing: no such object, or no bucket yet)


def endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("MLFLOW_S3_ENDPOINT_URL") or None


class Store:
    def __init__(self, uri: str, attempts: int = 3):
        import boto3
        from botocore.config import Config as BotoConfig

        if not uri.startswith("s3://"):
            raise ConfigError(f"storage.uri: expected s3://<bucket>[/<prefix>], got {uri!r}")
        self.uri = uri.rstrip("/")
        self.bucket, _, self.prefix = uri[5:].partition("/")
        self.prefix = self.prefix.strip("/")
        # (a session of its own: boto3's default session keeps the first credentials it read for the whole process)
        self.client = boto3.session.Session().client("s3", endpoint_url=endpoint(), region_name=os.environ.get("AWS_DEFAULT_REGION")
                                   or "us-east-1", config=BotoConfig(
                                       retries={"max_attempts": attempts, "mode": "standard"}, connect_timeout=5,
                                       read_timeout=60))

    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p)

    def ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError:
            self.client.create_bucket(Bucket=self.bucket)

    def upload_file(self, local: Path, key: str) -> None:
        self.client.upload_file(str(local), self.bucket, key)

    def upload_tree(self, local_dir: Path, prefix: str, skip=lambda relative: False) -> int:
        """Every file under `local_dir` to `prefix`/<its relative path> (but those `skip` names); the bytes sent."""
        size = 0
        for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            relative = path.relative_to(local_dir).as_posix()
            if not skip(relative):
                self.upload_file(path, f"{prefix}/{relative}")
                size += path.stat().st_size
        return size

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write `key` only if nothing is there yet (If-None-Match: *); False if it already was."""
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                return False
            raise

    def read(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ABSENT:
                return None
            raise

    def keys(self, prefix: str) -> list[str]:
        from botocore.exceptions import ClientError

        out, token = [], None
        while True:
            try:
                page = self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix.rstrip("/") + "/",
                                                   **({"ContinuationToken": token} if token else {}))
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") == "NoSuchBucket":
                    return []
                raise
            out += [item["Key"] for item in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return out
            token = page["NextContinuationToken"]

    def download(self, prefix: str, local_dir: Path, skip=lambda relative: False) -> list[Path]:
        """Every object under `prefix` (but those `skip` names), into `local_dir` (relative paths kept)."""
        written = []
        for key in self.keys(prefix):
            relative = key[len(prefix.rstrip("/")) + 1:]
            if skip(relative):
                continue
            target = local_dir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            self.client.download_file(self.bucket, key, str(target))
            written.append(target)
        return written

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})


def run_prefix(store: Store, run_name: str) -> str:
    return store.key("runs", run_name)


def checkpoints_prefix(store: Store, run_name: str) -> str:
    return store.key("runs", run_name, "checkpoints")


def part_key(store: Store, run_name: str, checkpoint: str, node: int) -> str:
    """A node's record that its part of a checkpoint is in the store (runs whose nodes share no filesystem)."""
    return f"{checkpoints_prefix(store, run_name)}/{checkpoint}/{PARTS_DIR}/node-{node}.json"


def checkpoint_keys(store: Store, run_name: str) -> dict[int, list[str]]:
    """step -> the keys under checkpoint-<step>/ of the run (complete or not), from one listing."""
    prefix = checkpoints_prefix(store, run_name)
    found: dict[int, list[str]] = {}
    for key in store.keys(prefix):
        name = key[len(prefix) + 1:].split("/")[0]
        if name.startswith("checkpoint-") and name[11:].isdigit():
            found.setdefault(int(name[11:]), []).append(key)
    return found


def marker_key(store: Store, run_name: str, step: int) -> str:
    return f"{checkpoints_prefix(store, run_name)}/checkpoint-{step}/{COMPLETE_MARKER}"


def complete_steps(store: Store, run_name: str, listed: dict[int, list[str]] | None = None) -> dict[int, dict]:
    """step -> the completion record of every checkpoint of the run that is complete in the store (`listed`: the
    run's checkpoint_keys, when the caller has them)."""
    import json

    listed = checkpoint_keys(store, run_name) if listed is None else listed
    return {step: json.loads(store.read(marker_key(store, run_name, step)) or b"{}")
            for step, keys in listed.items() if marker_key(store, run_name, step) in keys}
