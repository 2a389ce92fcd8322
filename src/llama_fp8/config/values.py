"""Values into fields: a flag string or a YAML value coerced to its field's type and checked against its
choices and range, and the YAML files (presets, ``--config``, a run's ``config.yaml``) read key by key.
Every refusal is a ConfigError naming the source, the key and what would be valid."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from llama_fp8.config.fields import TrainConfig
from llama_fp8.errors import ConfigError

PRESET_DIR = Path(__file__).parent.parent / "configs"
_FIELDS = {f.name: f for f in fields(TrainConfig)}


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


@functools.cache
def _hints() -> dict[str, Any]:
    # get_type_hints evaluates every annotation of the class: once per process, not once per flag (it was 60 ms of
    # each command's start)
    return typing.get_type_hints(TrainConfig)


def _base_type(f: dataclasses.Field) -> type:
    """The non-None type of a field (``int | None`` -> int)."""
    hint = _hints()[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean (use 0 or 1)")


def coerce(name: str, value: Any, source: str) -> Any:
    """Convert ``value`` (a flag string or a YAML value) to the type of field ``name``, or raise ConfigError."""
    f = _FIELDS[name]
    typ = _base_type(f)
    optional = f.default is None
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and optional):
        if optional:
            return None
        raise ConfigError(f"{source}: {name} may not be empty; {_valid(f)}")
    try:
        if typ is bool:
            out = value if isinstance(value, bool) else _parse_bool(str(value))
        elif typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("not an integer")
            out = int(value) if not isinstance(value, str) else int(value.strip())
        elif typ is float:
            if isinstance(value, bool):
                raise ValueError("not a number")
            out = float(value)
        elif typ is dict:
            out = yaml.safe_load(value) if isinstance(value, str) else value
            if not isinstance(out, dict):
                raise ValueError("not a mapping")
        else:
            out = str(value)
            out = f.metadata["aliases"].get(out, out)  # an older spelling: recorded as the name it stands for
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {name}={value!r} is not valid ({e}); {_valid(f)}") from None
    _check_range(f, out, source)
    return out


def choices_of(f: dataclasses.Field) -> tuple | None:
    """A field's valid values (None: any value of its type)."""
    c = f.metadata.get("choices")
    return c() if callable(c) else c


def help_of(f: dataclasses.Field) -> str:
    h = f.metadata["help"]
    return h() if callable(h) else h


def _valid(f: dataclasses.Field) -> str:
    md = f.metadata
    typ = _base_type(f)
    if choices_of(f):
        aliases = ", ".join(f"{old} = {new}" for old, new in md["aliases"].items())
        return "valid: " + ", ".join(choices_of(f)) + (f" (or {aliases})" if aliases else "")
    lo, hi = md.get("min"), md.get("max")
    kind = {bool: "0 or 1", int: "an integer", float: "a number", dict: "a YAML mapping"}.get(typ, "a string")
    if lo is not None and hi is not None:
        return f"valid: {kind} in [{lo}, {hi}]"
    if lo is not None:
        return f"valid: {kind} >= {lo}"
    return f"valid: {kind}"


def _check_range(f: dataclasses.Field, value: Any, source: str) -> None:
    md = f.metadata
    if choices_of(f) and value not in choices_of(f):
        raise ConfigError(f"{source}: {f.name}={value!r} is not valid; {_valid(f)}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if (md.get("min") is not None and value < md["min"]) or (md.get("max") is not None and value > md["max"]):
            raise ConfigError(f"{source}: {f.name}={value!r} is out of range; {_valid(f)}")


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def load_yaml(path: str, source_kind: str = "--config") -> dict[str, Any]:
    """Read a YAML mapping of TrainConfig fields, checking every key and value."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{source_kind} {path}: file not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{source_kind} {path}: not valid YAML ({e})") from None
    if isinstance(data, dict) and "asked" in data and "resolved" in data:
        data = data["asked"] or {}  # a run's config.yaml: run again what was asked
    if not isinstance(data, dict):
        raise ConfigError(f"{source_kind} {path}: expected a mapping of field: value, got {type(data).__name__}")
    out = {}
    for key, value in data.items():
        if key not in _FIELDS or key == "config":
            raise ConfigError(f"{source_kind} {path}: unknown key {key!r}{_suggest(str(key), list(_FIELDS))}; "
                              f"valid keys are the flags of `llama-fp8 train --help`")
        out[key] = coerce(key, value, f"{source_kind} {path}")
    return out


def load_preset(name: str) -> dict[str, Any]:
    presets = available_presets()
    if name not in presets:
        raise ConfigError(f"--model {name!r} is not a preset{_suggest(name, presets)}; valid: {', '.join(presets)}")
    values = load_yaml(str(PRESET_DIR / f"{name}.yaml"), source_kind=f"preset {name}")
    # A preset file names itself, so that `--config configs/NAME.yaml` selects its preset as `--model NAME` does.
    if values.get("model") != name:
        raise ConfigError(f"preset {name}: model: {values.get('model')} does not name this preset ({name}.yaml); "
                          f"write model: {name}")
    return values
