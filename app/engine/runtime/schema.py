"""One schema for run configs: every key of a config dataclass's dict (a RunConfig or GrpoConfig
with its train, data_config and rewards sections), with its type and its range or values.

The types come from the dataclasses' annotations (bool, int, float, str, `X | None`,
`tuple[X, ...]`, `tuple[X, X]`, a nested config dataclass); each class's SCHEMA_RULES (a
ClassVar beside its fields) adds what a type cannot say: a Range for every number, the allowed
values (or TEXT) for every string. A class's schema is built at its first use and building it
fails (a bug) when a field has no rule or a rule names no field, so a new field cannot be left
out. The configs live in their layers (TrainConfig in training, DataConfig in data, ...); this
module knows none of them.

`problems(d, cls)` lists everything wrong with a dict, one line per key (by its dotted path:
"train.lora_rank: expected an integer >= 1, got {}"; unknown keys with a close match);
`check(d, cls)` raises them all as one ConfigError. `read_config_file(path)` reads a JSON or
TOML config file; a file that does not parse is a ConfigError naming the line and column.
Cross-field rules (a hybrid run needs full_targets, ...) stay in the configs' validate().
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import tomllib
import types
import typing
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from app.engine.errors import ConfigError
from app.engine.runtime.files import loads_json
from app.engine.runtime.inputs import CONFIG_MAX_BYTES, open_input

INT_MAX = 2**31 - 1      # counts, sizes and seeds (and what the window's spin boxes hold)
TEXT = "text"            # the rule of a free-text string (a path, a field name, ...)
SHOWN_CHARS = 40         # a bad value is shown shortened to this


@dataclass(frozen=True)
class Range:
    """The numbers from lo to hi; an open end excludes its bound."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, x) -> bool:
        return ((self.lo < x if self.lo_open else self.lo <= x)
                and (x < self.hi if self.hi_open else x <= self.hi))

    def __str__(self) -> str:
        lo, hi = (str(int(x)) if float(x).is_integer() else f"{x:g}" for x in (self.lo, self.hi))
        if self.hi == math.inf:
            return "" if self.lo == -math.inf else f"{'>' if self.lo_open else '>='} {lo}"
        return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"


ANY = Range()
AT_LEAST_0, AT_LEAST_1 = Range(0), Range(1)
POSITIVE = Range(0, lo_open=True)
FRACTION = Range(0, 1, hi_open=True)          # [0, 1)


@dataclass(frozen=True)
class _Key:
    type: Any           # the annotation: bool, int, float, str, X | None, tuple[...], a dataclass
    rule: Any           # Range, allowed values, TEXT, or None (bool, dataclass)
    required: bool


def _unwrap(tp) -> tuple[Any, bool]:
    """(X, True) for the annotation `X | None`, else (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None)), True
    return tp, False


def _scalar(tp):
    """The type a rule applies to: `X | None` -> X, `tuple[X, ...]` -> X."""
    tp = _unwrap(tp)[0]
    return typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else tp


@functools.cache
def schema(cls) -> dict[str, _Key]:
    """{key: _Key} of a config dataclass; TypeError when RULES and the fields disagree."""
    rules = cls.SCHEMA_RULES
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        tp, rule = hints[f.name], rules.get(f.name)
        base = _scalar(tp)
        needs = {int: Range, float: Range, str: (tuple, str)}.get(base)
        if needs is not None and not isinstance(rule, needs):
            raise TypeError(f"schema: {cls.__name__}.{f.name} ({base.__name__}) needs a "
                            "rule in SCHEMA_RULES")
        if needs is None and not (base is bool or dataclasses.is_dataclass(base)):
            raise TypeError(f"schema: {cls.__name__}.{f.name} has a type it cannot check")
        if base is int:
            rule = Range(rule.lo, min(rule.hi, INT_MAX), rule.lo_open, rule.hi_open)
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out[f.name] = _Key(tp, rule, required)
    for name in set(rules) - set(out):
        if name != "kind":
            raise TypeError(f"schema: SCHEMA_RULES name no field of {cls.__name__}: {name}")
        out[name] = _Key(str, rules[name], False)   # the run's type: from_dict drops it
    return out


def shown(value) -> str:
    """A value as JSON, shortened."""
    try:
        text = json.dumps(value, default=str, ensure_ascii=False)
    except (ValueError, RecursionError):       # an int beyond the digit limit, deep nesting
        text = type(value).__name__
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 1] + "\u2026"


def _expected(tp, rule) -> str:
    """What a key of type `tp` (not `X | None`) with `rule` takes, in words."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple:
        each = _expected(args[0], rule)
        return (f"a list, each {each}" if args[-1] is Ellipsis
                else f"a list of {len(args)} items, each {each}")
    if dataclasses.is_dataclass(tp):
        return "an object"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string" if rule == TEXT else "one of " + ", ".join(rule)
    words = {int: "an integer", float: "a number" if rule != ANY else "a finite number"}[tp]
    return f"{words} {rule}".rstrip()


def _suggestion(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _value_problems(value, tp, rule, path: str) -> list[str]:
    tp, nullable = _unwrap(tp)
    if value is None and nullable:
        return []
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = [f"{path}: expected {_expected(tp, rule)}{' or null' * nullable}, got {shown(value)}"]
    if dataclasses.is_dataclass(tp):
        return problems(value, tp, path + ".") if isinstance(value, dict) else bad
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return bad
        items = args[:1] * len(value) if args[-1] is Ellipsis else args
        if len(items) != len(value):
            return bad
        return [p for i, (v, t) in enumerate(zip(value, items))
                for p in _value_problems(v, t, rule, f"{path}[{i}]")]
    if tp is bool:
        return [] if isinstance(value, bool) else bad
    if tp is str:
        if not isinstance(value, str):
            return bad
        if rule == TEXT or value in rule:
            return []
        return [bad[0] + _suggestion(value, rule)]
    number = isinstance(value, Integral if tp is int else Real) and not isinstance(value, bool)
    finite = number and (isinstance(value, Integral) or math.isfinite(value))
    return [] if finite and value in rule else bad


def problems(d, cls, prefix: str = "") -> list[str]:
    """Every problem of the dict `d` as a `cls` config, one line per key (see the module doc)."""
    keys = schema(cls)
    if not isinstance(d, dict):
        return [f"{prefix.rstrip('.') or 'the config'}: expected an object, got {shown(d)}"]
    out = [f"{prefix}{shown(key) if not isinstance(key, str) else key[:SHOWN_CHARS]}: unknown "
           f"setting{_suggestion(str(key), keys)}" for key in d if key not in keys]
    for name, key in keys.items():
        if name in d:
            out += _value_problems(d[name], key.type, key.rule, prefix + name)
        elif key.required:
            out.append(f"{prefix}{name}: missing (required)")
    return out


def check(d, cls, source: str = "") -> None:
    """Raise one ConfigError listing every problem of `d` as a `cls` config (see problems);
    `source` names where `d` comes from (a file)."""
    found = problems(d, cls)
    if found:
        where = f" in {os.path.basename(source)}" if source else ""
        raise ConfigError(f"Invalid settings{where} ({len(found)} problem"
                          f"{'s' * (len(found) > 1)}):\n  " + "\n  ".join(found),
                          "Fix these keys in the config file (or the options that set them).")


def read_config_file(path) -> dict:
    """A JSON (or, for *.toml, TOML) config file as a dict. A file that cannot be read, is not a
    regular file of at most CONFIG_MAX_BYTES (a pipe or /dev/zero would block or grow without
    end), does not parse (the error names the line and column) or is not an object raises
    ConfigError."""
    name = os.path.basename(os.fspath(path))
    kind = "TOML" if name.endswith(".toml") else "JSON"
    try:
        with open_input(path, "config file", max_bytes=CONFIG_MAX_BYTES, error=ConfigError) as f:
            raw = f.read(CONFIG_MAX_BYTES + 1)     # the cap holds if the file grew meanwhile
        if len(raw) > CONFIG_MAX_BYTES:
            raise ConfigError(f"The config file {os.fspath(path)} grew past 1 MB while read.",
                              "Check that this is the config file you meant.")
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"Could not read {name}: {getattr(e, 'strerror', None) or e}.",
                          "Check the path and that the file is readable text.") from None
    try:
        d = tomllib.loads(text) if kind == "TOML" else loads_json(text)
    except json.JSONDecodeError as e:
        reason = f"{e.msg} at line {e.lineno}, column {e.colno}"
    except ValueError as e:          # TOMLDecodeError's message ends "(at line L, column C)"
        reason = str(e)
    except RecursionError:
        reason = "nested too deeply"
    else:
        if isinstance(d, dict):
            return d
        reason = f"expected an object, got {shown(d)}"
    raise ConfigError(f"Could not read {name}: invalid {kind}: {reason}.",
                      "Fix the file, or save the settings again (a run's config.json is "
                      "written by the workbench).")
