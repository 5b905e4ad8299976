#!/usr/bin/env bash
# The test suite: the layer contracts (import-linter, pyproject.toml [tool.importlinter]), native GoogleTest
# suites through ctest, then pytest. Fast CPU tests only; slow ones: .venv/bin/python -m pytest -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/lint-imports --no-cache --no-logo
cmake --build build -j"$(nproc)" >/dev/null
ctest --test-dir build --output-on-failure -j2
# One worker per core (ZL_TEST_WORKERS, default 2; 0 runs in this process, as `pytest -p no:xdist` does), each
# taking whole files (a module's fixtures export once); the 25 slowest tests last, to keep the suite short.
.venv/bin/python -m pytest -q -n "${ZL_TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@"
