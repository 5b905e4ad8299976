"""Typer commands whose options are generated from a settings tree (zl/settings.py).

    export_command = settings_command(ExportArgs, run_export, doc)

gives a function that typer registers like a hand-written one: one keyword
parameter per option of the tree, with the field's flag, default and help; it
rebuilds the tree from the parsed values and calls `run(tree)`. To add an
option, add a field to the tree (see zl/settings.py); nothing here changes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from zl.settings import Leaf, build, format_value, leaves

T = TypeVar("T")


def settings_command(cls: type[T], run: Callable[[T], None], doc: str) -> Callable[..., None]:
    """A typer command function with the options of `cls`; it calls `run(cls instance)`."""
    options = leaves(cls)
    _check_unique(cls, options)

    def command(**values: Any) -> None:
        run(build(cls, values))

    command.__signature__ = inspect.Signature([_parameter(leaf) for leaf in options])  # type: ignore[attr-defined]
    command.__doc__ = doc
    command.__name__ = command.__qualname__ = run.__name__
    return command


def _parameter(leaf: Leaf) -> inspect.Parameter:
    annotation: Any = str if leaf.is_tuple else leaf.base
    if leaf.optional:
        annotation = annotation | None
    option = typer.Option(format_value(leaf, leaf.default), *leaf.flag.split(" "), help=leaf.help)
    return inspect.Parameter(leaf.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def _check_unique(cls: type, options: list[Leaf]) -> None:
    seen: dict[str, str] = {}
    for leaf in options:
        for name in leaf.flag.replace("/", " ").split():
            if name in seen:
                raise TypeError(f"{cls.__name__}: {name} is declared by both {seen[name]} and {leaf.name}")
            seen[name] = leaf.name
