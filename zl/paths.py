"""Checks of the paths a command will write, made before it does any work or writes anything.

Both have the signature of a setting's `check` (zl_base/settings.py): `check(path, flag)` raises a one-line ZLError
naming the flag, the path and the fix.
"""

from __future__ import annotations

from pathlib import Path

from zl_base.errors import ZLError


def check_out_dir(path: Path | str | None, flag: str) -> None:
    """`path` is a directory to create or write into: not a file, and no file where a parent folder must be."""
    if path is None:
        return
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ZLError(f"{flag} {path}: a file, not a directory; pass a new directory, e.g. {flag} "
                      f"{path.with_name(path.name + '.d')}.")
    _check_parents(path, flag)


def check_out_file(path: Path | str | None, flag: str, example: str = "out.json") -> None:
    """`path` is a file to create or replace: not a directory, and no file where a parent folder must be;
    `example` is the file name the fix suggests."""
    if path is None:
        return
    path = Path(path).expanduser()
    if path.is_dir():
        raise ZLError(f"{flag} {path}: a directory, not a file; name a file in it, e.g. {flag} {path / example}.")
    _check_parents(path, flag)


def _check_parents(path: Path, flag: str) -> None:
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ZLError(f"{flag} {path}: {parent} is a file, so no folder can be made under it; pick a path "
                              "outside it.")
            return
