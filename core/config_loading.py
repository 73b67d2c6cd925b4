"""Reading a config: YAML files (with `extends:`) and `key=value` overrides into core/config.py's dataclasses, each
value's type checked and each unknown key named. It knows none of the options.

    read_yaml(path)                      a file, its `extends:` chain merged under it
    parse_override / apply_override      `section.key=value` (the value read as YAML) onto the mapping
    build(cls, data, prefix)             a mapping -> the dataclass, types coerced and checked, keys named
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from core.errors import ConfigError


def _type_name(tp) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list"}.get(tp, str(tp))


def _coerce(key: str, value: Any, tp) -> Any:
    if tp is Any:  # checked where it is used (e.g. parallel.stage_layers: a word or a list)
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, (str, float)) and not isinstance(value, bool):
        try:  # "1e12" (YAML reads it as a string) or 1e+12: an integer written in scientific notation
            number = float(value)
            if number == int(number):
                return int(number)
        except (ValueError, OverflowError):
            pass
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown key {where}{unknown[0]}; allowed keys{' in ' + prefix if prefix else ''}: "
                          + ", ".join(fields))
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        kwargs[name] = build(tp, value, key) if dataclasses.is_dataclass(tp) else _coerce(key, value, tp)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`training.max_steps=40` -> (["training", "max_steps"], 40); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value, e.g. training.max_steps=40")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc.__class__.__name__})") from None
    return path, value


def apply_override(data: dict, path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(path)}: {part} is not a section")
    node[path[-1]] = value


def read_yaml(path: Path, seen: tuple = ()) -> dict:
    """One YAML file; `extends: other.yaml` (relative to it) is read first and deep-merged under it."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (see configs/ for examples)")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at line {line}); save the config as "
                          f"UTF-8") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: malformed YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    base = data.pop("extends", None)
    if base is None:
        return data
    base_path = (path.parent / str(base)).resolve()
    if base_path in seen:
        raise ConfigError(f"{path}: `extends` loops back to {base_path}")
    merged = read_yaml(base_path, seen + (base_path,))
    merged.pop("name", None)
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged
