"""Settings loaded from an optional YAML file and the environment, each value checked
against its dataclass field's type (:class:`ConfigError` naming the key otherwise; an
unknown key is refused with the closest known one), then validated as a whole."""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from federation_sender.config import ENV_PREFIX, Settings
from federation_sender.config.validation import validate_settings
from federation_sender.errors import ConfigError


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_describe(get_args(tp)[0])}"
    if origin is dict:
        return "a mapping of strings"
    if tp is type(None):
        return "null"
    if tp is float:
        return "a number"
    if tp is int:
        return "an integer"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, tp: Any, value: Any) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise ConfigError(key, "a mapping", value)
        return _build(tp, value, key + ".")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(key, _describe(tp), value)
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, arg, value)
            except ConfigError:
                continue
        raise ConfigError(key, _describe(tp), value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, _describe(tp), value)
        (inner,) = get_args(tp)
        return [_coerce(f"{key}[{i}]", inner, v) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise ConfigError(key, _describe(tp), value)
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, _describe(tp), value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, _describe(tp), value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, _describe(tp), value)
        return float(value)
    if tp is str:
        if not isinstance(value, str) or value == "":
            raise ConfigError(key, "a non-empty string", value)
        return value
    raise ConfigError(key, _describe(tp), value)  # pragma: no cover


def _build(cls: type[Any], data: Mapping[str, Any], prefix: str = "") -> Any:
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            close = difflib.get_close_matches(str(k), sorted(names), n=1, cutoff=0.6)
            hint = f"did you mean {prefix + close[0]!r}? " if close else ""
            raise ConfigError(prefix + str(k),
                              f"a known key ({hint}see docs/configuration.md)", None)
    kwargs = {k: _coerce(prefix + k, hints[k], v) for k, v in data.items()}
    return cls(**kwargs)


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(".".join(path), "a mapping", nxt)
        node = nxt
    node[path[-1]] = value


def load_settings(
    path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Load settings from ``path`` (optional) and the environment; validate everything."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError("<file>", f"a readable YAML file at {str(p)!r}", e.strerror) from e
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise ConfigError("<file>", f"valid YAML{where}", None) from e
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError("<file>", "a YAML mapping at the top level", type(loaded).__name__)
        tree = loaded
    env = os.environ if environ is None else environ
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]
        if not parts:
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        if value is None and raw != "null":
            value = raw
        _set_path(tree, parts, value)
    settings: Settings = _build(Settings, tree)
    validate_settings(settings)
    return settings



def iter_keys(cls: type[Any] = Settings, prefix: str = "") -> list[str]:
    """All dotted keys, for the documentation check."""
    out: list[str] = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            out.extend(iter_keys(tp, prefix + f.name + "."))
        else:
            out.append(prefix + f.name)
    return out
