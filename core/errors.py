"""The one error type of the bottom layer: a problem the user must fix, with a message that says how."""


class ConfigError(ValueError):
    """A config (or input) problem the user must fix; the message says which key and what is allowed."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
