#!/usr/bin/env python3
"""The backprop baseline's command line; the baseline is zl_study/backprop_baseline.py (`--help` says how to run it)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from zl_study.backprop_baseline import main  # noqa: E402

main()
