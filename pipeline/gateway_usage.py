"""`make gateway-usage`: one row per consumer and model version: requests answered and refused (429), prompt and
completion tokens (the answers' `usage`), all from the gateway's access log (serving/gateway/usage.py)."""
from __future__ import annotations

from core.config import Config
from serving.gateway import nginx, usage
from pipeline.runner.cli import config_argument, overrides_argument

HELP = "requests, tokens and 429s per consumer and model through the gateway"


def arguments(p) -> None:
    config_argument(p)
    overrides_argument(p, "section.key=value, e.g. gateway.port=18190")


def main(config: Config, args) -> int:
    print(usage.format_table(usage.table(nginx.state_dir(config))))
    return 0
