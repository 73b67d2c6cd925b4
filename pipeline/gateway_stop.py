"""`make gateway-stop`: stop the gateway `make gateway` started (keys and logs are kept)."""
from __future__ import annotations

from core.config import Config
from serving.gateway import nginx


def main(config: Config, args) -> int:
    print("gateway stopped" if nginx.stop(config) else "no gateway was running")
    return 0
