"""`make gateway`: nginx in front of the serving replicas (gateway.backends; default this config's `make serve`), the
one listener meant for clients (docs/gateway.md). Running already: its configuration is rendered again and
reloaded (no restart)."""
from __future__ import annotations

from core.config import Config
from serving.gateway import nginx
from pipeline.runner.cli import config_argument, overrides_argument

HELP = "nginx in front of the serving replicas: keys, limits, usage, split, failover"


def arguments(p) -> None:
    config_argument(p)
    overrides_argument(p, "section.key=value, e.g. gateway.port=18190")


def main(config: Config, args) -> int:
    state = nginx.start(config)
    pools = ", ".join(f"{pool}: {' '.join(urls)}" + (f" ({config.gateway.split[pool]}%)" if config.gateway.split
                                                      else "") for pool, urls in state["pools"].items())
    print(f"gateway (nginx, pid {state['pid']}) -> {pools}\n"
          f"keys: make gateway-key NAME=<consumer> RPM=<requests per minute> [TPM=<tokens per minute>]\n"
          f"OpenAI base URL: {state['url']}/v1\n"
          f"url: {state['url']}")
    return 0
