"""The arguments most verbs take, written once: `--config` and the trailing `section.key=value` overrides. Each verb
declares its own arguments beside its `main` (`arguments(parser)`); pipeline/__main__.py only dispatches."""
from __future__ import annotations

import re
import shlex

from core.config import DEFAULT_CONFIG

_OVERRIDE = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*=")  # (a word that starts an override: section.key=)
CONFIG_HELP = f"YAML config (default {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parent.parent)})"


def config_argument(p, more: str = "") -> None:
    p.add_argument("--config", default=None, help=CONFIG_HELP + more)


def overrides_argument(p, text: str = "section.key=value overrides") -> None:
    p.add_argument("overrides", nargs="*", help=text)


def words(given: list[str]) -> list[str]:
    """The command line as the verbs parse it. `--args TEXT` (the Makefile's ARGS, passed whole) becomes TEXT's words,
    split as a POSIX shell splits them (quotes kept together) but never globbed or brace-expanded. Then the pieces of
    an override whose value has spaces are joined back: `gateway.split={a: 90, b: 10}` reaches a verb as one
    override whether the shell split it or not. A word continues the override before it while that override's
    brackets are open, or when the word is neither a flag nor a `key=` of its own (`data.text=a b`)."""
    expanded: list[str] = []
    rest = iter(given)
    for word in rest:
        if word == "--args" or word.startswith("--args="):
            text = word[len("--args="):] if word.startswith("--args=") else next(rest, "")
            try:
                expanded += shlex.split(text)
            except ValueError as exc:  # (an unclosed quote)
                from core.errors import ConfigError

                raise ConfigError(f"ARGS {text!r}: {exc}") from None
        else:
            expanded.append(word)
    joined: list[str] = []
    open_override = False  # (the last word is an override that a value's piece may continue)
    for word in expanded:
        continues = open_override and (_unbalanced(joined[-1]) or not (word.startswith("-") or _OVERRIDE.match(word)))
        if continues:
            joined[-1] += " " + word
        else:
            joined.append(word)
            open_override = bool(_OVERRIDE.match(word))
    return joined


def _unbalanced(override: str) -> bool:
    value = override.split("=", 1)[1]
    return value.count("{") > value.count("}") or value.count("[") > value.count("]")
