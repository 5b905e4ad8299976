#!/usr/bin/env bash
# The test suite: the layer contracts (import-linter, pyproject.toml [tool.importlinter]), native GoogleTest
# suites through ctest, then pytest. Fast CPU tests only; slow ones: .venv/bin/python -m pytest -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/lint-imports --no-cache --no-logo
cmake --build build -j"$(nproc)" >/dev/null
ctest --test-dir build --output-on-failure -j2
.venv/bin/python -m pytest -q --durations=25 "$@"  # the 25 slowest tests last, to keep the suite short
