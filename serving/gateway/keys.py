"""Consumers' API keys for the gateway: `keys.json` (consumer -> key, requests and tokens per minute) in
gateway.keys_dir, outside the repository, readable by its owner alone. A key is printed once, when it is made,
and never again: not in logs (nginx's access log names the consumer, not the key), not in MLflow. The gateway's
key map (`keys.map`, rendered beside it) is what nginx reads; `make gateway-key REVOKE=<consumer>` rewrites it and
reloads nginx."""
from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path

from core.errors import ConfigError
from core.files import atomic_write

KEYS_FILE, MAP_FILE = "keys.json", "keys.map"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def keys_dir(config) -> Path:
    if config.gateway.keys_dir:
        return Path(config.gateway.keys_dir).expanduser().resolve()
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return (base / "paddle-train-to-serve" / "gateway").resolve()


def read(directory: Path) -> dict:
    """{consumer: {"key", "rpm", "tpm", "created"}}."""
    path = directory / KEYS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def create(directory: Path, name: str, rpm: int, tpm: int = 0) -> str:
    """A new key for consumer `name` (replacing its old one), with its limits; returns the key."""
    if not NAME.fullmatch(name or ""):
        raise ConfigError(f"NAME={name!r}: a consumer name is 1-64 letters, digits, '_', '.' or '-'")
    if rpm < 1 or tpm < 0:
        raise ConfigError(f"RPM={rpm} TPM={tpm}: RPM must be >= 1 (requests per minute) and TPM >= 0 (tokens per "
                          f"minute; 0 = no token budget)")
    keys = read(directory)
    key = "sk-" + secrets.token_urlsafe(32)
    keys[name] = {"key": key, "rpm": rpm, "tpm": tpm, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _write(directory, keys)
    return key


def revoke(directory: Path, name: str) -> bool:
    keys = read(directory)
    if name not in keys:
        return False
    del keys[name]
    _write(directory, keys)
    return True


def _write(directory: Path, keys: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(directory / KEYS_FILE, json.dumps(keys, indent=1), mode=0o600)
    # nginx's map from the Authorization header to the consumer ("Bearer <key>" <consumer>;)
    atomic_write(directory / MAP_FILE, "".join(f'"Bearer {v["key"]}" "{name}";\n' for name, v in sorted(keys.items())),
                 mode=0o600)
