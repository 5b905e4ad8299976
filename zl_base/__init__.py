"""The base layer of zl: what every part imports and nothing of zl's own is imported by.

- `zl_base.errors`: `ZLError`, the one user-error type, and `read_json_file` (a JSON file or that error);
- `zl_base.settings`: settings trees (nested dataclasses whose fields carry their default, flag, help and check);
- `zl_base.entry`: `run_cli`, how a zl command line runs (logging, ZLError as one line, exit status 2);
- `__version__`, the package's version (pyproject.toml reads it from here).

The layers above it, from the bottom: `zl_export` (ahead-of-time) and `custom_ops`, `zl_device` (devices, runs,
results), and the CLI `zl` on top, which nothing imports (tools/importlinter.ini checks it).
"""

__version__ = "0.1.0"
