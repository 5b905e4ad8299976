"""How a zl command line runs: `run_cli(entry)` for `zl` (zl/cli.py) and the tools' command lines alike.

Errors of type `ZLError` print as one line and exit with status 2; set `ZL_DEBUG=1` for the traceback and debug
logging.
"""

import logging
import os
import sys
import warnings

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
