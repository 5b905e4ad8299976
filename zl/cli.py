"""The `zl` command line: the root app only wires the command modules.

Errors of type `ZLError` print as one line and exit with status 2; set
`ZL_DEBUG=1` for the traceback.
"""

import logging
import os
import sys

import typer

from zl.errors import ZLError

app = typer.Typer(
    name="zl",
    help="ZeroLock: fine-tune LLMs with LoRA on a pipeline of devices, without backpropagation across them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    from zl.commands import data, export

    app.command("export")(export.export_command)
    app.command("data")(data.data_command)


def main() -> None:
    debug = os.environ.get("ZL_DEBUG") == "1"
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _register()
    try:
        app()
    except ZLError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
