"""Typer commands whose options are generated from a settings tree (zl_base/settings.py).

    export_command = settings_command(ExportArgs, run_export, doc)

gives a function that typer registers like a hand-written one: one keyword
parameter per option of the tree, with the field's flag, default and help; it
rebuilds the tree from the parsed values and calls `run(tree)`. To add an
option, add a field to the tree (see zl_base/settings.py); nothing here changes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from zl_base.settings import Leaf, build, format_value, leaves

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
    command.settings = cls  # type: ignore[attr-defined]  # the tree, for tests and docs
    return command


def _parameter(leaf: Leaf) -> inspect.Parameter:
    # A tuple option is one comma-separated string; a tuple argument takes several values.
    annotation: Any = (list[leaf.base] if leaf.argument else str) if leaf.is_tuple else leaf.base
    if leaf.optional:
        annotation = annotation | None
    default = ... if leaf.required else format_value(leaf, leaf.default)
    if leaf.argument:
        info = typer.Argument(default, help=leaf.help, metavar=leaf.argument, show_default=default is not None)
    else:
        info = typer.Option(default, *leaf.flag.split(" "), help=leaf.help, show_default=default is not None)
    return inspect.Parameter(leaf.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def _check_unique(cls: type, options: list[Leaf]) -> None:
    seen: dict[str, str] = {}
    for leaf in options:
        for name in ([] if leaf.argument else leaf.flag.replace("/", " ").split()):
            if name in seen:
                raise TypeError(f"{cls.__name__}: {name} is declared by both {seen[name]} and {leaf.name}")
            seen[name] = leaf.name
