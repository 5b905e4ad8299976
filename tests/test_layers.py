"""The layers where import-linter does not look: tools/ holds scripts, no package.

The packages' layers and the absence of import cycles are import-linter contracts (pyproject.toml
[tool.importlinter], run by tools/test.sh); a script is a top like the CLI, but it builds on the libraries, not on
the CLI package `zl`: what it shares with `zl` (ZLError, `run_cli`) lives in zl_base.
"""

from __future__ import annotations

import ast

from conftest import REPO


def _imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in `source`, inside functions too."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return sorted(out)


def test_tools_do_not_import_the_cli_package():
    found = [f"{path.relative_to(REPO)}:{line} imports {module}"
             for path in sorted((REPO / "tools").glob("*.py"))
             for line, module in _imported_modules(path.read_text())
             if module == "zl" or module.startswith("zl.")]
    assert not found, "import from zl_base (or the libraries) instead: " + "; ".join(found)


def test_the_check_sees_imports_inside_functions():
    assert _imported_modules("def f():\n    from zl.cli import run_cli\nimport zl_base\n") == [(2, "zl.cli"), (3, "zl_base")]
