"""Settings trees: nested dataclasses whose fields carry their own default, flag and help text.

`zl export` and `zl train` take their options from such trees (`ExportOptions`,
`TrainSettings`); zl/options.py turns a tree into typer options and the
command line back into the tree. So one field declaration is the only place
an option's default, flag and help live, and each dataclass's `validate()`
checks its own fields with one-line `ZLError`s (flag, bad value, fix).

How to add an option: declare one field, nothing else. For example, in
zl_export/options.py:

    @dataclass(frozen=True)
    class LossConfig:
        ...
        readout_rank: int = setting(0, "Rank of the readout translator; 0 turns it off, e.g. 4.")

`--readout-rank` then appears in `zl export --help` and `zl train --help`,
reaches the exporter as `opts.loss.readout_rank`, is written into
`asdict(opts.loss)` (so the export cache key follows) and is checked where
you check it, in `LossConfig.validate()`:

        if self.readout_rank < 0:
            raise ZLError(f"{flag(LossConfig, 'readout_rank')} {self.readout_rank}: must be 0 (off) or more.")

Types: int, float, str, Path, bool (`--x/--no-x`), `X | None`, and
`tuple[float, ...]` / `tuple[int, ...]` / `tuple[str, ...]`, which the
command line takes comma-separated (`--stage-lr 1,1,2`). Keywords of
`setting`: `flag="--name"` when the flag is not the field name with dashes,
`choices=(...)` for a str with fixed values, `check=fn` for a range or shape
the value must have (`fn(value, flag)` raises a `ZLError` naming the flag,
the value, the limit and the fix), `cli=False` for a field that is no option,
`argument="METAVAR"` for a positional argument instead of an option (a
tuple argument takes several values). `setting(REQUIRED, "help")` is an
option without a default that the command line must give (declare such
fields first: they have no default in Python either).
Each class's `validate()` calls `check_fields(self)`, which applies both, so
every command that shares an option gets its checks:

    seq_len: int = setting(128, "Tokens per sample.", check=check_seq_len)
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zl_base.errors import ZLError

_HELP, _FLAG, _CHOICES, _CHECK, _CLI, _NESTED, _SKIP, _ARGUMENT = ("help", "flag", "choices", "check", "cli", "nested",
                                                                   "skip", "argument")

#: The default of a setting the command line must give: `setting(REQUIRED, "help")` (no default in Python either).
REQUIRED: Any = dataclasses.MISSING

#: `check(value, flag)` of a setting: raises ZLError when `value` is out of range.
Check = Callable[[Any, str], None]


def setting(default: Any, help: str, *, flag: str | None = None, choices: tuple[str, ...] | None = None,
            check: Check | None = None, cli: bool = True, argument: str | None = None) -> Any:
    """A dataclass field that is an option: its default (or REQUIRED), help text and (unless derived from the name)
    flag, and what `check_fields` checks: `choices`, and `check(value, flag)`. With `argument` (its metavar, e.g.
    "RUN_DIR") it is a positional argument instead."""
    if choices is not None and default not in (None, REQUIRED) and default not in choices:
        raise ValueError(f"default {default!r} is not one of the choices {choices}")
    if argument is not None and flag is not None:
        raise ValueError(f"argument {argument} has no flag; drop flag={flag!r}")
    return dataclasses.field(default=default, metadata={_HELP: help, _FLAG: flag, _CHOICES: choices, _CHECK: check,
                                                        _CLI: cli, _ARGUMENT: argument})


def nested(cls: type, *, skip: tuple[str, ...] = ()) -> Any:
    """A dataclass field holding another settings dataclass; its options join the parent's.

    `skip` names fields of `cls` that the parent declares itself (with its own default and help); they keep
    `cls`'s default inside the nested value.
    """
    return dataclasses.field(default_factory=cls, metadata={_NESTED: True, _SKIP: tuple(skip)})


def flag(cls: type, name: str) -> str:
    """The command-line flag of field `name` of `cls`, e.g. flag(LoraSettings, "rank") == "--lora-rank" (an
    argument's metavar, e.g. "RUN_DIR")."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.metadata.get(_ARGUMENT):
        return f.metadata[_ARGUMENT]
    given = f.metadata.get(_FLAG)
    return given.split("/")[0].split()[0] if given else "--" + name.replace("_", "-")  # "--out -o" -> "--out"


def check_choices(obj: Any) -> None:
    """Raise ZLError for a field of `obj` declared with `choices` whose value is not one of them."""
    for f in dataclasses.fields(obj):
        choices = f.metadata.get(_CHOICES)
        value = getattr(obj, f.name)
        if choices and value is not None and value not in choices:
            raise ZLError(f"{flag(type(obj), f.name)} {value!r}: expected one of {', '.join(choices)}.")


def check_fields(obj: Any) -> None:
    """Raise ZLError for a field of `obj` (not of its nested trees) that is not one of its `choices` or fails its
    `check`; the message names the flag."""
    check_choices(obj)
    for f in dataclasses.fields(obj):
        check = f.metadata.get(_CHECK)
        if check is not None:
            check(getattr(obj, f.name), flag(type(obj), f.name))


@dataclass(frozen=True)
class Leaf:
    """One option of a settings tree: where it lives (`path` of attribute names) and how it is typed."""

    path: tuple[str, ...]
    field: dataclasses.Field
    base: type  # int, float, str, bool, Path, ... (the item type for a tuple)
    optional: bool
    is_tuple: bool

    @property
    def name(self) -> str:
        """A Python identifier unique in the tree, e.g. export__loss__alpha."""
        return "__".join(self.path)

    @property
    def argument(self) -> str | None:
        """The metavar of a positional argument (None: an option)."""
        return self.field.metadata.get(_ARGUMENT)

    @property
    def required(self) -> bool:
        return self.field.default is REQUIRED and self.field.default_factory is dataclasses.MISSING

    @property
    def flag(self) -> str:
        if self.argument:
            return self.argument
        given = self.field.metadata.get(_FLAG)
        if given:
            return given
        dashed = "--" + self.path[-1].replace("_", "-")
        return f"{dashed}/--no-{dashed[2:]}" if self.base is bool else dashed

    @property
    def help(self) -> str:
        return self.field.metadata[_HELP]

    @property
    def default(self) -> Any:
        return self.field.default


def leaves(cls: type, path: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> list[Leaf]:
    """The options of the tree rooted at `cls`, depth first in declaration order (the order of --help)."""
    hints = typing.get_type_hints(cls)
    out: list[Leaf] = []
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        if f.metadata.get(_NESTED):
            out += leaves(hints[f.name], path + (f.name,), f.metadata[_SKIP])
        elif _HELP in f.metadata and f.metadata[_CLI]:
            base, optional, is_tuple = _shape(hints[f.name])
            out.append(Leaf(path + (f.name,), f, base, optional, is_tuple))
    return out


def build(cls: type, values: dict[str, Any], path: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> Any:
    """The tree `cls` from option values keyed by `Leaf.name`; tuple options may be comma-separated strings.

    Fields without a value keep their defaults.
    """
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        here = path + (f.name,)
        if f.metadata.get(_NESTED):
            kwargs[f.name] = build(hints[f.name], values, here, f.metadata[_SKIP])
        elif "__".join(here) in values:
            value = values["__".join(here)]
            base, _, is_tuple = _shape(hints[f.name])
            if is_tuple and isinstance(value, str):
                value = parse_list(value, base, flag(cls, f.name))
            elif is_tuple and isinstance(value, list):  # a tuple argument: its values
                value = tuple(value)
            if base is float:
                check_finite(value, flag(cls, f.name), f.default)
            kwargs[f.name] = value
    return cls(**kwargs)


def to_json(obj: Any) -> dict[str, Any]:
    """Every field of a settings tree, as JSON values (nested trees as objects, paths as strings, tuples as lists)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = to_json(value)
        elif isinstance(value, tuple):
            value = list(value)
        elif value is not None and not isinstance(value, (bool, int, float, str)):
            value = str(value)
        out[f.name] = value
    return out


def from_json(cls: type, data: Any, where: str = "settings", *, others: bool = False,
              fix: str = "it was damaged, or written by another version of zl") -> Any:
    """The tree `cls` from `to_json`'s output, every field checked against its type and range by the typed reader
    (zl_base/json_reader.py `typed`). Fields the data lacks keep their defaults.

    Args:
        others: the data may hold other keys besides the fields (a manifest's notes); they are left aside.
        fix: what an error says to do.

    Raises:
        ZLError: the data has a field `cls` does not (unless `others`), or a field of the wrong type or range; the
            message names `where` and the field.
    """
    from zl_base.json_reader import typed

    return typed(cls, data, where, fix, others=others)


def parse_list(text: str, item: type, name: str) -> tuple:
    """"0.3,0.7,1.0" -> (0.3, 0.7, 1.0); empty items are dropped. Raises ZLError naming `name` (the flag)."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    try:
        return tuple(item(t) for t in parts)
    except ValueError:
        example = {int: "1,1,2", float: "0.3,0.7,1.0"}.get(item, "a,b")
        raise ZLError(f"{name} {text}: expected comma-separated {item.__name__} values, e.g. {name} {example}.") from None


def check_finite(value: float | tuple[float, ...] | None, name: str, default: Any = None) -> None:
    """Raise ZLError when a float option (or an item of a float list) is nan or infinite.

    The command line parses "nan" and "inf" as floats, and nan passes every range check (`nan <= 0` is False), so
    every float option of every command is checked here, as it is parsed (`build`). `default` gives the example.
    """
    values = value if isinstance(value, tuple) else (value,)
    bad = [v for v in values if v is not None and not math.isfinite(v)]
    if bad:
        shown = f"{','.join(f'{v:g}' for v in values)}: {bad[0]:g} is" if isinstance(value, tuple) else f"{bad[0]:g}:"
        example = ",".join(map(str, default)) if isinstance(default, tuple) else default
        example = "0.5" if example in (None, REQUIRED) else example
        raise ZLError(f"{name} {shown} not a finite number; give a number, e.g. {name} {example}.")


def format_value(leaf: Leaf, value: Any) -> Any:
    """A default as the command line writes it (tuples comma-separated)."""
    if leaf.is_tuple and value is not None:
        return ",".join(str(v) for v in value)
    return value


def _shape(tp: Any) -> tuple[type, bool, bool]:
    """(base type, optional, is_tuple) of a field's type hint."""
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        if len(args) != 1:
            raise TypeError(f"settings support X | None, not {tp}")
        tp = args[0]
    if typing.get_origin(tp) is tuple:
        return typing.get_args(tp)[0], optional, True
    return tp, optional, False
