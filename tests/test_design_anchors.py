"""The design documents' citations (docs/design/README.md): every section has an explicit anchor, unique across the
files; code cites `docs/design#<anchor>` and Markdown links to `design/<file>.md#<anchor>`; each cited anchor
exists, in the file a link names; no citation by section number is left (a renumbering broke those silently)."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design"
SKIP_DIRS = {".git", ".venv", "runs", "__pycache__", ".pytest_cache", ".import_linter_cache", "node_modules"}
CODE = {".py", ".sh", ".cpp", ".h", ".kt", ".kts", ".java", ".txt", ".toml", ".cmake"}
ANCHOR = re.compile(r'<a id="([\w-]+)"></a>')
CODE_CITE = re.compile(r"docs/design#([\w-]+)((?:(?:, and |, | and |, or )#[\w-]+)*)")
MD_LINK = re.compile(r"\]\(([^)\s]*?(?:design/)?[\w-]+\.md)?#([\w-]+)\)")
SECTION = re.compile(r"§\d")
# A section sign stays right for the documents that still number their sections: the wire protocol's
# (runner/PROTOCOL.md) and the original brief (DESIGN.md).
OTHER_NUMBERED = re.compile(r"PROTOCOL|DESIGN\b")


def _files():
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith("build")]
        for name in names:
            path = Path(root) / name
            if path.suffix in CODE or path.suffix == ".md":
                yield path


def _anchors() -> dict[str, dict[str, int]]:
    """file name -> anchor -> count."""
    found = {}
    for path in sorted(DESIGN.glob("*.md")):
        ids = ANCHOR.findall(path.read_text())
        found[path.name] = {a: ids.count(a) for a in ids}
    return found


def test_every_design_section_has_one_anchor_unique_across_the_files():
    anchors = _anchors()
    assert "README.md" in anchors and len(anchors) > 10, sorted(anchors)
    owners = {}
    for name, ids in anchors.items():
        for a, n in ids.items():
            assert n == 1 and a not in owners, f"anchor {a!r} in {name} and {owners.get(a, name)}"
            owners[a] = name
    for path in DESIGN.glob("*.md"):
        lines, fenced, headings = path.read_text().splitlines(), False, []
        for i, ln in enumerate(lines):
            fenced ^= ln.startswith("```")
            if not fenced and re.match(r"#{1,4} ", ln):
                headings.append(i)
        bare = [lines[i] for i in headings if i == 0 or not ANCHOR.fullmatch(lines[i - 1])]
        assert not bare or path.name == "README.md" and bare == ["# zl — design"], (path.name, bare)


def test_every_citation_of_the_design_names_an_anchor_that_exists():
    anchors = _anchors()
    everywhere = {a for ids in anchors.values() for a in ids}
    broken = []
    for path in _files():
        text = path.read_text(errors="replace")
        rel = path.relative_to(REPO)
        if path.suffix != ".md":
            for m in CODE_CITE.finditer(text):
                for a in [m.group(1)] + re.findall(r"#([\w-]+)", m.group(2)):
                    if a not in everywhere:
                        broken.append(f"{rel}: docs/design#{a}")
            continue
        for m in MD_LINK.finditer(text):
            target, a = m.group(1), m.group(2)
            if target is None:
                if path.parent == DESIGN and a not in anchors[path.name]:
                    broken.append(f"{rel}: #{a}")
                continue
            resolved = (path.parent / target).resolve()
            if resolved.parent == DESIGN.resolve():
                if a not in anchors.get(resolved.name, {}):
                    broken.append(f"{rel}: {target}#{a}")
    assert not broken, broken


def test_no_citation_by_section_number_or_of_the_single_design_file_is_left():
    left = []
    for path in _files():
        rel = path.relative_to(REPO)
        if rel.as_posix() in ("runner/PROTOCOL.md", "tests/test_design_anchors.py"):
            continue
        text = path.read_text(errors="replace")
        for m in SECTION.finditer(text):
            if not OTHER_NUMBERED.search(text[max(0, m.start() - 90):m.start()]):
                line = text.count("\n", 0, m.start()) + 1
                left.append(f"{rel}:{line}: {text[max(0, m.start() - 30):m.end() + 10]!r}")
        if "design.md" in text.replace("DESIGN.md", ""):
            left.append(f"{rel}: names design.md (now docs/design/)")
    assert not left, left
