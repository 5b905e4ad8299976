"""The base layer of zl: what every part imports and nothing of zl's own is imported by.

- `zl_base.errors`: `ZLError`, the one user-error type;
- `zl_base.json_reader`: `read_json_file` and `typed`, the one typed reader of the JSON files zl reads back;
- `zl_base.files`: `file_sha256`;
- `zl_base.settings`: settings trees (nested dataclasses whose fields carry their default, flag, help and check);
- `zl_base.entry`: `run_cli`, how a zl command line runs (logging, ZLError as one line, exit status 2);
- `__version__`, the package's version (pyproject.toml reads it from here).

The layers above it, from the bottom: `custom_ops`, `zl_export` (ahead-of-time: export, data shards), `zl_device`
(the host side of a run: devices, the run's flow, the ExecuTorch and torch runtimes, results, planning), and on top
the CLI `zl` and the research layer `zl_study` (the accuracy study, the backprop baseline, gradient alignment,
emulated devices), which import each other not at all and which nothing imports (the import-linter contracts in
pyproject.toml check it).
"""

__version__ = "0.1.0"
