"""The one typed reader of the JSON files zl reads back: plans, resolved runs, train settings, stage configs.

A file a run wrote can be edited, truncated or replaced before it is read again (`zl train --resume`,
`zl train --stages plan.json`). Reading it goes in two steps, each ending in one `ZLError` line that names the
file, where in it, and the fix:

    data = read_json_file(path, "plan runs/x/plan.json", missing=..., invalid=...)   # a JSON value, or the error
    plan = typed(PlanRecord, data, "plan runs/x/plan.json", fix="make it again with `zl plan`")

`typed(tp, value, label, fix)` checks `value` against the type hint `tp` and returns it as that type: a dataclass
from an object (field by field, by its type hints; a field with a default may be absent, a key no field names is
refused unless `others=True`), `int` (an integer, not a bool or a float: `1e9` is no sequence length), `float` (a
finite number), `str`, `bool`, `X | None`, `tuple[X, ...]`, `tuple[X, Y]`, `list[X]`, `dict[str, X]`, `Path`
(from a string), `Literal[...]` and `Any`. A range is part of the type, as `Annotated[int, Bounds(1)]`; a class's
own rules (its `__post_init__` raising ValueError) are reported at the object's path. An error reads

    plan runs/x/plan.json: "per_stage[1].phase1_ms" is "fast", expected a number; make it again with `zl plan`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zl_base.errors import ZLError

#: How deep a file zl reads back may nest: its own files nest 4 levels at most.
MAX_DEPTH = 64


@dataclass(frozen=True)
class Bounds:
    """A number's range, as `Annotated[int, Bounds(1)]` (at least 1), `Bounds(2, 8192)` (inclusive) or
    `Bounds(above=0)` (more than 0), `Bounds(0, below=1)` (0 up to, not including, 1)."""

    low: float | None = None
    high: float | None = None
    above: float | None = None
    below: float | None = None

    def check(self, value: float) -> str | None:
        """The range `value` misses ("at least 1"), or None."""
        if self.above is not None and not value > self.above:
            return f"more than {self.above:g}"
        if self.low is not None and value < self.low:
            return f"at least {self.low:g}"
        if self.high is not None and value > self.high:
            return f"at most {self.high:g}"
        if self.below is not None and not value < self.below:
            return f"less than {self.below:g}"
        return None


def loads(text: str | bytes, label: str, invalid: str) -> Any:
    """The JSON value of `text` (a file's contents), nesting at most MAX_DEPTH levels.

    Raises:
        ZLError: "<label>: not valid JSON (<why>, line N); <invalid>" (or not UTF-8 text, or nested too deep, or a
            number Python will not parse).
    """
    from zl_base.json_nesting import nests_deeper_than

    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ZLError(f"{label}: not a text file ({e.reason} at byte {e.start}); {invalid}") from None
    if nests_deeper_than(text, MAX_DEPTH):
        raise ZLError(f"{label}: nests deeper than {MAX_DEPTH} levels, which no file of zl does; {invalid}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ZLError(f"{label}: not valid JSON ({e.msg}, line {e.lineno}); {invalid}") from None
    except (ValueError, RecursionError) as e:  # an integer of over 4,300 digits
        raise ZLError(f"{label}: not valid JSON ({e}); {invalid}") from None


def read_json_file(path: Path, label: str, *, missing: str, invalid: str) -> Any:
    """The JSON value in the file at `path` (`loads`).

    Args:
        label: how the error names the file, e.g. "manifest runs/x/manifest.json".
        missing: the fix when there is no such file; invalid: the fix when it is not valid JSON.

    Raises:
        ZLError: "<label>: no such file; <missing>", or `loads`' errors.
    """
    if not path.is_file():
        raise ZLError(f"{label}: no such file; {missing}")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ZLError(f"{label}: unreadable ({e.strerror}); {invalid}") from None
    return loads(raw, label, invalid)


def read_typed(path: Path, tp: Any, label: str, fix: str, *, others: bool = False) -> Any:
    """The file at `path` as type `tp`: `read_json_file` then `typed`, every error naming `label` and ending in
    `fix` (no such file, not JSON, a field of the wrong type or range)."""
    return typed(tp, read_json_file(path, label, missing=fix + ".", invalid=fix + "."), label, fix, others=others)


def typed(tp: Any, value: Any, label: str, fix: str, path: str = "", *, others: bool = False) -> Any:
    """`value` (a JSON value) as type `tp`, checked all the way down (module docstring).

    Args:
        label: how errors name the file; fix: what they say to do; path: where `value` is in the file ("" the top).
        others: a dataclass's object may hold keys no field names (left aside), at every level.

    Raises:
        ZLError: '<label>: "<path>" is <value>, expected <what>; <fix>.'
    """
    return _Typed(label, fix, others).of(tp, value, path)


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """Where two JSON values first differ, depth first in key order: (path, a's value, b's value), a value that is
    absent shown as `ABSENT`; None when they are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            at = _at(path, key)
            if key not in a or key not in b:
                return at, a.get(key, ABSENT), b.get(key, ABSENT)
            if (found := first_difference(a[key], b[key], at)) is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if (found := first_difference(x, y, f"{path}[{i}]")) is not None:
                return found
        return None
    return None if a == b and isinstance(a, bool) == isinstance(b, bool) else (path, a, b)


class _Absent:
    def __repr__(self) -> str:
        return "absent"


#: `first_difference`'s value of a key one side lacks.
ABSENT: Any = _Absent()


def shown(value: Any, limit: int = 40) -> str:
    """A JSON value as an error shows it, cut at `limit` characters."""
    if value is ABSENT:
        return "absent"
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _Typed:
    def __init__(self, label: str, fix: str, others: bool):
        self.label, self.fix, self.others = label, fix, others

    def fail(self, path: str, problem: str) -> ZLError:
        where = f'"{path}"' if path else "the file"
        return ZLError(f"{self.label}: {where} {problem}; {self.fix}.")

    def wrong(self, path: str, value: Any, expected: str) -> ZLError:
        return self.fail(path, f"is {shown(value)}, expected {expected}")

    def of(self, tp: Any, value: Any, path: str) -> Any:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Annotated:
            out = self.of(args[0], value, path)
            for rule in args[1:]:
                problem = rule.check(out) if isinstance(rule, Bounds) and out is not None else None
                if problem:
                    raise self.wrong(path, value, problem)
            return out
        if tp is Any:
            return value
        if origin in (typing.Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            kinds = [a for a in args if a is not type(None)]
            if len(kinds) == 1:
                return self.of(kinds[0], value, path)
            for kind in kinds:
                try:
                    return self.of(kind, value, path)
                except ZLError:
                    continue
            raise self.wrong(path, value, " or ".join(_name(k) for k in kinds))
        if origin is typing.Literal:
            if value not in args or isinstance(value, bool) != any(isinstance(a, bool) for a in args):
                raise self.wrong(path, value, "one of " + ", ".join(shown(a) for a in args))
            return value
        if dataclasses.is_dataclass(tp):
            return self.dataclass(tp, value, path)
        if origin in (tuple, list):
            if origin is tuple and len(args) == 2 and args[1] is Ellipsis and _is_scalar(value):
                value = [value]  # one number for all: a settings file from before the option took a list
            if not isinstance(value, list):
                raise self.wrong(path, value, _name(tp))
            if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
                if len(value) != len(args):
                    raise self.wrong(path, value, _name(tp))
                items = [self.of(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
            else:
                item = args[0] if args else Any
                items = [self.of(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
            return tuple(items) if origin is tuple else items
        if origin is dict or tp is dict:
            if not isinstance(value, dict):
                raise self.wrong(path, value, "an object")
            item = args[1] if args else Any
            return {k: self.of(item, v, f"{path}.{k}" if path else k) for k, v in value.items()}
        if tp is bool:
            if not isinstance(value, bool):
                raise self.wrong(path, value, "true or false")
            return value
        if tp is int:
            if not isinstance(value, int) or isinstance(value, bool):
                raise self.wrong(path, value, "an integer")
            return value
        if tp is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise self.wrong(path, value, "a finite number")
            return float(value)
        if tp is str or tp is Path:
            if not isinstance(value, str):
                raise self.wrong(path, value, "a string")
            return tp(value)
        raise TypeError(f"typed: no rule for {tp!r} at {path or 'the top'}")

    def dataclass(self, cls: type, value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise self.wrong(path, value, "an object")
        hints = typing.get_type_hints(cls, include_extras=True)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(value) - set(fields))
        if unknown and not self.others:
            raise self.fail(_at(path, unknown[0]), f"is no field of {cls.__name__}")
        kwargs = {}
        for name, f in fields.items():
            if name in value:
                kwargs[name] = self.of(hints[name], value[name], _at(path, name))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise self.fail(_at(path, name), "is missing")
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as e:  # the class's own rules (__post_init__)
            raise self.fail(path, f"is not a valid {cls.__name__} ({e})") from None


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _at(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _name(tp: Any) -> str:
    """A type as an error names it: "an integer", "a list of numbers", ..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _name(args[0])
    if origin in (tuple, list):
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            return f"a list of {len(args)} values"
        return f"a list of {_plural(args[0]) if args else 'values'}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_name(a) for a in args)
    if dataclasses.is_dataclass(tp):
        return f"an object ({tp.__name__})" if isinstance(tp, type) else "an object"
    return {int: "an integer", float: "a finite number", str: "a string", bool: "true or false", Path: "a string",
            type(None): "null", dict: "an object"}.get(tp, str(tp))


def _plural(tp: Any) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(tp, "values")
