"""This checkout's `zl` command line for the benchmarks (not whatever the venv's `zl` script was installed from)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def checkout_zl(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(command, environment) that run `zl ARGS` from this checkout, with this checkout's zl_runner unless
    ZL_RUNNER_BIN names another."""
    cmd = [sys.executable, "-c", "import sys; from zl.cli import main; sys.argv[0] = 'zl'; sys.exit(main())", *args]
    runner = REPO / "build" / "runner" / "zl_runner"
    env = dict(os.environ, PYTHONPATH=str(REPO), ZL_RUNNER_BIN=os.environ.get("ZL_RUNNER_BIN", str(runner)))
    return cmd, env
