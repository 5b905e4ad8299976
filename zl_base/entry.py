"""How a zl command line runs: `run_cli(entry)` for `zl` (zl/cli.py) and the tools' command lines alike.

Errors of type `ZLError` print as one line and exit with status 2; so do the command-line framework's own errors
(an option value that does not parse, an unknown option) when the entry runs typer with `standalone_mode=False`;
set `ZL_DEBUG=1` for the traceback and debug logging. A command that starts processes stops them when it is
stopped itself: `stopped_by_signals` turns SIGTERM, like Ctrl-C, into an exception that runs its cleanup.
"""

import logging
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from zl_base.errors import ZLError

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


def usage_error_line(e: typer.TyperException) -> str:
    """A typer (click) usage error as one line: the command, the option and the value seen, what was expected, and
    where the help is; e.g. "zl train --max-temperature 'abc': input should be a valid number, unable to parse
    string as a number; see `zl train --help`."."""
    ctx = getattr(e, "ctx", None)
    command = ctx.command_path if ctx is not None else "zl"
    param = getattr(e, "param", None)
    if param is not None and getattr(e, "message", None):  # a value that does not parse (BadParameter)
        name = param.opts[0] if getattr(param, "opts", None) else (param.human_readable_name or param.name).upper()
        reason = " ".join(str(e.message).split())
        seen = _input_of(e)
        what = f"{command} {name}" + ("" if seen is None else f" {seen!r}")
        return f"{what}: {reason[:1].lower()}{reason[1:]}; see `{command} --help`."
    return f"{command}: {' '.join(e.format_message().split()).rstrip('.')}; see `{command} --help`."


def _input_of(e: BaseException) -> object | None:
    """The value a parse error saw, where the framework's cause kept it (a pydantic ValidationError's input)."""
    errors = getattr(e.__cause__, "errors", None)
    try:
        return errors()[0]["input"] if callable(errors) else None
    except (IndexError, KeyError, TypeError):
        return None


class Stopped(KeyboardInterrupt):
    """A command stopped by a signal (SIGINT: Ctrl-C; SIGTERM: `kill`, a service manager, a CI timeout), raised in the
    main thread wherever it was, so that cleanup (`finally`, `except BaseException`) runs as after Ctrl-C. A
    KeyboardInterrupt, so code that does not catch Ctrl-C does not catch this either."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(self.name)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shells' status for a process ended by the signal: 128 + its number (SIGINT 130, SIGTERM 143)."""
        return 128 + self.signum


@contextmanager
def stopped_by_signals(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Within: each of `signums` raises `Stopped` in the main thread. Only the first does: further ones while its
    cleanup runs (stopping processes takes seconds) are ignored, so a second Ctrl-C cannot leave them half stopped
    (SIGKILL still ends the command). The previous handlers come back on leaving."""
    stopping: list[int] = []

    def stop(signum: int, frame) -> None:
        if not stopping:
            stopping.append(signum)
            raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_cli(entry) -> None:
    """Run `entry()` as a zl command line: logging, quiet third parties, ZLError and the framework's usage errors as
    one line and exit 2. `entry` may return an exit status (typer's, with `standalone_mode=False`)."""
    debug = os.environ.get("ZL_DEBUG") == "1"
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not debug:
        _quiet_third_party()
    try:
        code = entry()
    except ZLError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except typer.TyperException as e:  # click's UsageError, BadParameter, ... (typer vendors click)
        if debug:
            raise
        if type(e).__name__ != "NoArgsIsHelpError":  # `zl` alone: typer printed the help already
            print(f"error: {usage_error_line(e)}", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 2))
    except typer.Abort:  # end of input at a prompt
        sys.exit(1)
    if isinstance(code, int) and code:
        sys.exit(code)  # typer's Exit status (130 after Ctrl-C)
