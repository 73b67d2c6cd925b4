"""`make gateway-usage`: one row per consumer: requests answered and refused (429) from the gateway's access log,
prompt and completion tokens from the replicas' metrics (the answers' `usage`, counted by consumer)."""
from __future__ import annotations

from core.config import Config
from serving.gateway import nginx, usage

HELP = "requests, tokens and 429s per consumer through the gateway"


def arguments(p) -> None:
    from pipeline.runner.cli import config_argument, overrides_argument

    config_argument(p)
    overrides_argument(p, "section.key=value, e.g. gateway.port=18190")


def main(config: Config, args) -> int:
    rows, unreachable = usage.table(nginx.state_dir(config), [u for urls in nginx.pools(config).values() for u in urls])
    print(usage.format_table(rows))
    for url in unreachable:
        print(f"(replica {url} did not answer: its tokens are not in the table)")
    return 0
