"""How an option is declared, read and checked: the machinery under core/config.py, which declares the options
themselves. It knows none of them.

    option(default, allowed=..., above=..., minimum=...)   a field's default with its allowed values or its bound,
                                                           in the one declaration (core/config.py's sections)
    check_declared(section, prefix)                        those checked, each failure one line naming the key
    build(cls, data, prefix)                               a mapping -> the dataclass, types checked, keys named
    read_yaml(path) / parse_override / apply_override      YAML files (with `extends:`) and `key=value` overrides
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from core.errors import ConfigError, require


def option(default: Any = dataclasses.MISSING, *, factory=None, allowed: tuple | None = None,
           above: float | None = None, minimum: float | None = None):
    """A field with its checks in its declaration: `allowed` values (the default first), a value `above` a bound
    (> it) or at least `minimum` (>= it). README's config reference is checked against these (tests/unit/
    test_docs.py)."""
    rules = {k: v for k, v in (("allowed", allowed), ("above", above), ("minimum", minimum)) if v is not None}
    if allowed is not None:
        assert (factory() if factory else default) == allowed[0], "the default is the first allowed value"
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=rules)
    return dataclasses.field(default=default, metadata=rules)


def one_of(key: str, value: Any, allowed: tuple) -> None:
    require(value in allowed, f"{key}: {value!r} is not allowed; use one of {', '.join(map(repr, allowed))}")


def positive(key: str, value: float) -> None:
    require(value > 0, f"{key}: must be > 0, got {value}")


def check_declared(section, prefix: str) -> None:
    """The rules `option` declared on `section`'s fields, in declaration order."""
    for f in dataclasses.fields(section):
        key, value, rules = f"{prefix}.{f.name}", getattr(section, f.name), f.metadata
        if "allowed" in rules:
            one_of(key, value, rules["allowed"])
        if "above" in rules:
            require(value > rules["above"], f"{key}: must be > {rules['above']:g}, got {value}")
        if "minimum" in rules:
            require(value >= rules["minimum"], f"{key}: must be >= {rules['minimum']:g}, got {value}")


def declared(section_class) -> dict[str, dict]:
    """field name -> {"default": ..., and the rules `option` declared}, for the docs' checks."""
    out = {}
    for f in dataclasses.fields(section_class):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out[f.name] = {"default": default, **f.metadata}
    return out


# -- reading ----------------------------------------------------------------------------------------------------------
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
