"""One module per `zl` command group; `zl.cli` wires them into the root app."""
