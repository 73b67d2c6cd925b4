"""`make object-store-stop`: stop the local S3 endpoint `make object-store` started (its data is kept)."""
from __future__ import annotations

from core.config import Config
from pipeline.runner.seaweedfs import stop

HELP = "stop the local S3 endpoint (its data is kept)"


def main(config: Config, args) -> int:
    print("stopped" if stop() else "no object store was running")
    return 0
