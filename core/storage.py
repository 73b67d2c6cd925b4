"""The object store's client (`storage.uri` = s3://bucket/prefix): any S3 endpoint, through boto3. What is kept
there, and how (checkpoints, markers, the writer lease), is training/checkpoint/'s; data sets: training/data/published.py.

Endpoint and credentials come from the standard environment that boto3 and MLflow read: AWS_ENDPOINT_URL (or
MLFLOW_S3_ENDPOINT_URL), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION. boto3 rather than MLflow's
artifact repository because a checkpoint needs what that repository does not offer: conditional writes
(If-None-Match, If-Match: a completion marker written once, a lease with one holder), listing by prefix and deleting.

Every failure is named in one line by `StoreError` (`describe`): the store unreachable, the credentials refused,
permission denied, no such bucket. `check` tries endpoint, credentials and bucket (a write and its delete) before a
launch; `retrying` rides a short outage.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import uuid

from core.errors import ConfigError

ABSENT = ("NoSuchKey", "404", "NoSuchBucket")  # (error codes of a read of nothing: no such object, or no bucket yet)
AUTH = ("SignatureDoesNotMatch", "InvalidAccessKeyId", "InvalidToken", "ExpiredToken", "AuthorizationHeaderMalformed",
        "InvalidSecurity", "TokenRefreshRequired")
PERMISSION = ("AccessDenied", "AllAccessDisabled", "AccountProblem")
PRECONDITION = ("PreconditionFailed", "412", "ConditionalRequestConflict")


class StoreError(ConfigError):
    """A store failure, in one line: which store, what was being done, and the cause by kind (`kind`: unreachable,
    auth, permission, no-bucket, other)."""

    def __init__(self, message: str, kind: str = "other"):
        super().__init__(message)
        self.kind = kind


def endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("MLFLOW_S3_ENDPOINT_URL") or None


def error_code(exc) -> str:
    """The S3 error code of a botocore ClientError ("NoSuchKey", "PreconditionFailed", "404" ...), "" if none."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def describe(exc: BaseException) -> tuple[str, str]:
    """(kind, one line) for a failure of a store call. An HTTP 403 without a code (HEAD requests carry no body) is
    read as refused credentials only by the caller that knows; here it is `permission`."""
    from botocore import exceptions as be

    if isinstance(exc, StoreError):
        return exc.kind, str(exc)
    if isinstance(exc, (be.EndpointConnectionError, be.ConnectTimeoutError, be.ReadTimeoutError,
                        be.ConnectionClosedError)) or isinstance(exc, ConnectionError):
        return "unreachable", f"unreachable ({exc.__class__.__name__}: {exc})"
    if isinstance(exc, be.NoCredentialsError):
        return "auth", "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    if isinstance(exc, be.ClientError):
        code, status = error_code(exc), exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        text = f"{code}: {exc.response.get('Error', {}).get('Message', '')}".rstrip(": ")
        if code in AUTH:
            return "auth", f"the credentials were refused ({text}); check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        if code in PERMISSION or code == "403" or status == 403:
            return "permission", f"permission denied ({text})"
        if code in ("NoSuchBucket",):
            return "no-bucket", "no such bucket"
        if status is not None and status >= 500:
            return "unreachable", f"the store failed ({text}, HTTP {status})"
        return "other", text
    return "other", f"{exc.__class__.__name__}: {exc}"


def retrying(fn, what: str, store: "Store"):
    """fn(), retried with backoff while the store is unreachable, for up to the store's `retry_s` (storage.retry_s);
    any other failure, or one that lasts, raises StoreError in one line."""
    retry_s = store.retry_s
    deadline, delay = time.monotonic() + retry_s, 0.5
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001  (named below)
            kind, text = describe(exc)
            if kind != "unreachable" or time.monotonic() + delay > deadline:
                lasted = f" for {retry_s:g}s (storage.retry_s)" if kind == "unreachable" else ""
                raise StoreError(f"{store.name()}: {what}: {text}{lasted}", kind) from None
            time.sleep(delay)
            delay = min(delay * 2, 8.0)


class Store:
    def __init__(self, uri: str, attempts: int = 3, retry_s: float = 30.0, threads: int = 8):
        import boto3
        from botocore.config import Config as BotoConfig

        if not uri.startswith("s3://"):
            raise ConfigError(f"storage.uri: expected s3://<bucket>[/<prefix>], got {uri!r}")
        self.uri, self.retry_s, self.threads = uri.rstrip("/"), retry_s, threads
        self.bucket, _, self.prefix = uri[5:].partition("/")
        self.prefix = self.prefix.strip("/")
        # (a session of its own: boto3's default session keeps the first credentials it read for the whole process)
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint(), region_name=os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
            config=BotoConfig(retries={"max_attempts": attempts, "mode": "standard"}, connect_timeout=5,
                              read_timeout=60, max_pool_connections=max(10, threads * 2)))

    @classmethod
    def of(cls, s, uri: str = "", attempts: int = 3) -> "Store":
        """The store `uri` (default storage.uri) with the storage section's settings (retries, transfer threads)."""
        return cls(uri or s.uri, attempts=attempts, retry_s=s.retry_s, threads=s.transfer_threads)

    def name(self) -> str:
        return f"{self.uri} at {endpoint() or 'the default AWS endpoint'}"

    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p)

    def check(self) -> float:
        """Endpoint, credentials and bucket, with a write and its delete under the prefix; the bucket is made if
        missing. StoreError in one line otherwise. The seconds it took."""
        began = time.monotonic()
        probe = self.key(f".write-check-{uuid.uuid4().hex[:12]}")
        try:  # (a listing, not HEAD: a HEAD's 403 cannot tell refused credentials from a missing permission)
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.key("") or "", MaxKeys=1)
        except Exception as exc:  # noqa: BLE001
            if describe(exc)[0] != "no-bucket":
                raise StoreError(f"{self.name()}: {describe(exc)[1]}", describe(exc)[0]) from None
            self._call(lambda: self.client.create_bucket(Bucket=self.bucket), f"creating bucket {self.bucket}")
        self._call(lambda: self.client.put_object(Bucket=self.bucket, Key=probe, Body=b""), "a test write")
        self._call(lambda: self.client.delete_object(Bucket=self.bucket, Key=probe), "deleting the test write")
        return time.monotonic() - began

    def _call(self, fn, what: str):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            kind, text = describe(exc)
            raise StoreError(f"{self.name()}: {what}: {text}", kind) from None

    def ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError:
            try:
                self.client.create_bucket(Bucket=self.bucket)
            except ClientError as exc:  # (two nodes starting at once: the other one's create came first)
                if error_code(exc) != "BucketAlreadyOwnedByYou":
                    raise

    def upload_file(self, local: Path, key: str) -> None:
        self.client.upload_file(str(local), self.bucket, key)

    def upload_tree(self, local_dir: Path, prefix: str, skip=lambda relative: False) -> int:
        """Every file under `local_dir` to `prefix`/<its relative path> (but those `skip` names), `threads`
        at a time (storage.transfer_threads); the bytes sent. The first failure raises once every transfer has ended."""
        files = [(p, p.relative_to(local_dir).as_posix()) for p in sorted(local_dir.rglob("*")) if p.is_file()]
        files = [(p, r) for p, r in files if not skip(r)]
        with ThreadPoolExecutor(self.threads) as pool:
            for future in [pool.submit(self.upload_file, p, f"{prefix}/{r}") for p, r in files]:
                future.result()
        return sum(p.stat().st_size for p, _ in files)

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write `key` only if nothing is there yet (If-None-Match: *); False if it already was."""
        return self.put_if(key, data, IfNoneMatch="*") is not None

    def put_if(self, key: str, data: bytes, **condition) -> str | None:
        """Write `key` on a condition (IfNoneMatch="*", or IfMatch=<ETag>): its new ETag, or None if the condition
        did not hold."""
        from botocore.exceptions import ClientError

        try:
            return self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **condition)["ETag"]
        except ClientError as exc:
            if error_code(exc) in PRECONDITION:
                return None
            raise

    def delete_if(self, key: str, etag: str) -> bool:
        """Delete `key` if it is still the version `etag`."""
        from botocore.exceptions import ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=key, IfMatch=etag)
            return True
        except ClientError as exc:
            if error_code(exc) in (*PRECONDITION, *ABSENT):
                return False
            raise

    def read(self, key: str) -> bytes | None:
        found = self.read_versioned(key)
        return found[0] if found else None

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """(bytes, ETag) of `key`, or None if there is none."""
        from botocore.exceptions import ClientError

        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=key)
            return answer["Body"].read(), answer["ETag"]
        except ClientError as exc:
            if error_code(exc) in ABSENT:
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
                if error_code(exc) == "NoSuchBucket":
                    return []
                raise
            out += [item["Key"] for item in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return out
            token = page["NextContinuationToken"]

    def download(self, prefix: str, local_dir: Path, skip=lambda relative: False) -> list[Path]:
        """Every object under `prefix` (but those `skip` names), into `local_dir` (relative paths kept),
        `threads` at a time."""
        wanted = []
        for key in self.keys(prefix):
            relative = key[len(prefix.rstrip("/")) + 1:]
            if not skip(relative):
                wanted.append((key, local_dir / relative))
        for _, target in wanted:
            target.parent.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(self.threads) as pool:
            for future in [pool.submit(self.client.download_file, self.bucket, k, str(t)) for k, t in wanted]:
                future.result()
        return [t for _, t in wanted]

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})
