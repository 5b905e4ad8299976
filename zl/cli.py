"""The `zl` command line: the root app only wires the command modules.

Errors of type `ZLError` print as one line and exit with status 2; set
`ZL_DEBUG=1` for the traceback (`run_cli`, zl_base/entry.py).
"""

import typer

from zl_base.entry import run_cli

app = typer.Typer(
    name="zl",
    help="ZeroLock: fine-tune LLMs with LoRA on a pipeline of devices (phones), no stage waiting on another.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# `zl --help` lists commands in this order (pipeline order); each module in
# zl/commands/ declares its commands in a COMMANDS dict {name: function}.
_ORDER = ("train", "plan", "export", "data", "devices", "deploy", "pull", "report", "merge", "eval", "generate",
          "export-model")


def _register() -> None:
    import importlib
    import pkgutil

    import zl.commands

    found = {}
    for info in pkgutil.iter_modules(zl.commands.__path__):
        module = importlib.import_module(f"zl.commands.{info.name}")
        found.update(getattr(module, "COMMANDS", {}))
    for name in sorted(found, key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n)):
        app.command(name)(found[name])


def main() -> None:
    _register()
    # Not standalone: typer raises its usage errors (a bad option value, an unknown option) instead of printing its
    # boxed message, so run_cli prints them as the house's one line.
    run_cli(lambda: app(prog_name="zl", standalone_mode=False))


if __name__ == "__main__":
    main()
