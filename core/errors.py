"""The one error type of the bottom layer: a problem the user must fix, with a message that says how; and the one
check of a user's .jsonl line (fine-tuning data, `make generate`'s input)."""
import json


class ConfigError(ValueError):
    """A config (or input) problem the user must fix; the message says which key and what is allowed."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def json_object(line: str, where: str, expected: str) -> dict:
    """One line of a .jsonl file as a JSON object, else a one-line error naming `where` (file:line)."""
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"{where}: not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected {expected}")
    return record
