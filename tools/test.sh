#!/usr/bin/env bash
# The test suite: native GoogleTest suites through ctest, then pytest.
# Fast CPU tests only; slow ones: .venv/bin/python -m pytest -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build build -j"$(nproc)" >/dev/null
ctest --test-dir build --output-on-failure -j2
.venv/bin/python -m pytest -q "$@"
