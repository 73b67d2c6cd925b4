"""The arguments most verbs take, written once: `--config` and the trailing `section.key=value` overrides. Each verb
declares its own arguments beside its `main` (`arguments(parser)`); pipeline/__main__.py only dispatches."""
from __future__ import annotations

from core.config import DEFAULT_CONFIG

CONFIG_HELP = f"YAML config (default {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parent.parent)})"


def config_argument(p, more: str = "") -> None:
    p.add_argument("--config", default=None, help=CONFIG_HELP + more)


def overrides_argument(p, text: str = "section.key=value overrides") -> None:
    p.add_argument("overrides", nargs="*", help=text)
