#!/usr/bin/env python3
"""The gradient-alignment probe's command line; the probe is zl_study/grad_alignment.py (`--help`: how to run it)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from zl_study.grad_alignment import main  # noqa: E402

sys.exit(main())
