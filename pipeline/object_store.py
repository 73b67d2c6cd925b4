"""`make object-store`: a local S3 endpoint (SeaweedFS) on 127.0.0.1:8333 for `storage.uri` (docs/storage.md);
its credentials in runs/object-store/credentials.env (pipeline/runner/seaweedfs.py)."""
from __future__ import annotations

from core.config import Config
from pipeline.runner.seaweedfs import STATE_DIR, start

HELP = "a local S3 endpoint (SeaweedFS) for storage.uri, on 127.0.0.1:8333"


def main(config: Config, args) -> int:
    state = start()
    print(f"object store (SeaweedFS S3): {state['endpoint']} (pid {state['pid']}); use it with\n"
          f"  source {STATE_DIR / 'credentials.env'}\n"
          f"  make train ARGS=\"storage.uri=s3://pipeline/<prefix>\"")
    return 0
