"""The `zl` command line: the root app only wires the command modules.

Errors of type `ZLError` print as one line and exit with status 2; set
`ZL_DEBUG=1` for the traceback.
"""

import logging
import os
import sys
import warnings

import typer

from zl.errors import ZLError

app = typer.Typer(
    name="zl",
    help="ZeroLock: fine-tune LLMs with LoRA on a pipeline of devices, without backpropagation across them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# `zl --help` lists commands in this order (pipeline order); each module in
# zl/commands/ declares its commands in a COMMANDS dict {name: function}.
_ORDER = ("train", "export", "data", "devices", "deploy", "pull", "report", "merge", "eval", "generate")


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


# Third-party chatter that says nothing to a zl user: torchao's optional CUDA
# extensions that cannot load on a CPU build, torch's pytree deprecation notes
# for torchao's enums, and ExecuTorch's "experimental API" warnings.
_QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "torch._export", "torch.export", "executorch")
_QUIET_WARNINGS = (
    ("ignore", "This API is experimental"),
    ("ignore", ".*is deprecated.*"),
)


def _quiet_third_party() -> None:
    # transformers' per-load tqdm bars ("Loading weights") would interleave with zl's own progress display.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for action, message in _QUIET_WARNINGS:
        warnings.filterwarnings(action, message=message)
    warnings.filterwarnings("ignore", category=FutureWarning)


def run_cli(entry) -> None:
    """Run `entry()` as a zl command line: logging, quiet third parties, ZLError as one line and exit 2."""
    debug = os.environ.get("ZL_DEBUG") == "1"
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not debug:
        _quiet_third_party()
    try:
        entry()
    except ZLError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    _register()
    run_cli(app)


if __name__ == "__main__":
    main()
