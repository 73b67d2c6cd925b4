"""`make gateway-stop`: stop the gateway `make gateway` started (keys and logs are kept)."""
from __future__ import annotations

from core.config import Config
from serving.gateway import nginx
from pipeline.runner.cli import config_argument, overrides_argument

HELP = "stop the gateway (keys and logs are kept)"


def arguments(p) -> None:
    config_argument(p)
    overrides_argument(p, "section.key=value, e.g. gateway.port=18190")


def main(config: Config, args) -> int:
    print("gateway stopped" if nginx.stop(config) else "no gateway was running")
    return 0
