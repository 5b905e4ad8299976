"""The benchmarks, studies and build helpers (each a script: `python tools/<name>.py`), a package only so that the
import-linter contracts (pyproject.toml) cover them: they sit above every part of zl and nothing imports them."""
