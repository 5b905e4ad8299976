"""Prompt/completion rows from named columns: `--prompt-column`, `--completion-column`, `--prompt-template`.

`DataColumns` is a settings tree (zl_base/settings.py) that `zl data` and `zl train` both nest, so each option is
declared once here. A template builds the prompt from several columns: `{column}` is that column's text, `\\n`
and `\\t` are a line break and a tab (so a shell argument can carry them), `{{` and `}}` are literal braces:

    --prompt-template "Title: {title}\\nText: {description}\\nSummary:" --completion-column summary
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

from zl_base.errors import ZLError
from zl_base.settings import setting
from zl_export.records import at_row, json_kind


@dataclass(frozen=True)
class DataColumns:
    """Which columns (CSV) or keys (JSONL) of a prompt/completion file hold the prompt and the completion."""

    prompt_column: str | None = setting(None, "Column (CSV) or key (JSONL) holding the prompt (default: prompt), "
                                              "e.g. --prompt-column question.")
    completion_column: str | None = setting(None, "Column or key holding the completion (default: completion), "
                                                  "e.g. --completion-column answer.")
    prompt_template: str | None = setting(None, "Build the prompt from several columns instead: {column} is its "
                                                "text, \\n a line break, e.g. --prompt-template "
                                                "\"Title: {title}\\nText: {description}\\nSummary:\".")

    def given(self) -> bool:
        return any(v is not None for v in (self.prompt_column, self.completion_column, self.prompt_template))

    def validate(self) -> None:
        """Raise ZLError for both --prompt-column and --prompt-template, an empty name, or a template that
        names no column or uses more than plain {column} fields."""
        for flag_, value in (("--prompt-column", self.prompt_column), ("--completion-column", self.completion_column)):
            if value is not None and not value.strip():
                raise ZLError(f"{flag_} {value!r}: empty; name a column of the file, e.g. {flag_} "
                              f"{'question' if 'prompt' in flag_ else 'answer'}.")
        if self.prompt_column is not None and self.prompt_template is not None:
            raise ZLError(f"--prompt-column {self.prompt_column} and --prompt-template both given; pass one (a "
                          f"template can hold the column: --prompt-template \"{{{self.prompt_column}}}\").")
        if self.prompt_template is not None:
            template_fields(self.prompt_template)

    @property
    def completion(self) -> str:
        return (self.completion_column or "completion").strip().lower()

    @property
    def prompt(self) -> str:
        return (self.prompt_column or "prompt").strip().lower()

    def needed(self) -> list[str]:
        """The columns the file must have: the prompt's (the template's fields) and the completion's."""
        fields = template_fields(self.prompt_template) if self.prompt_template is not None else [self.prompt]
        return list(dict.fromkeys(fields + [self.completion]))


def template_fields(template: str) -> list[str]:
    """The column names a prompt template refers to (lower-cased, as the reader lower-cases headers), in order.

    Raises:
        ZLError: unbalanced braces, a field with a format spec, conversion or no name, or no field at all.
    """
    fix = "write {column} for a column's text and {{ or }} for a literal brace"
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ZLError(f"--prompt-template {template!r}: {e}; {fix}.") from None
    fields = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.strip() or spec or conversion:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise ZLError(f"--prompt-template {template!r}: field {shown} is not a plain column name; {fix}.")
        fields.append(name.strip().lower())
    if not fields:
        raise ZLError(f"--prompt-template {template!r}: names no column; {fix}, e.g. \"Text: {{description}}\\nSummary:\".")
    return list(dict.fromkeys(fields))


def render_template(template: str, row: dict[str, str]) -> str:
    """`template` with each {column} replaced by the row's text and \\n, \\t escapes expanded."""
    out = []
    for literal, name, _, _ in string.Formatter().parse(template):
        out.append(literal.replace("\\n", "\n").replace("\\t", "\t"))
        if name is not None:
            out.append(row[name.strip().lower()])
    return "".join(out)


def column_rows(path: Path, columns: list[str], records, cols: DataColumns) -> list[tuple[int, str, str]]:
    """(line, prompt, completion) of every row, from the columns `cols` names.

    Raises:
        ZLError: a named column the file lacks (naming it and the file's columns), a value that is not text, an
            empty completion, or an empty prompt (a template: all its columns empty).
    """
    cols.validate()
    for name in cols.needed():
        if name not in columns:
            which, given = (("--completion-column", cols.completion_column) if name == cols.completion else
                            ("--prompt-template", cols.prompt_template) if cols.prompt_template is not None else
                            ("--prompt-column", cols.prompt_column))
            default = "" if given is not None else f" (the default; pass {which} NAME)"
            raise ZLError(f"{which}: column {name!r}{default} is not in {path}, which has "
                          f"{', '.join(columns) or '(none)'}; name one of those (or fix the file's header).")
    rows = []
    for line, r in records:
        for name in cols.needed():
            if not isinstance(r.get(name, ""), str):
                raise ZLError(f"{at_row(path, line)}: column {name!r} is a JSON {json_kind(r[name])}; expected text. "
                              "Put the text in a string (\"...\"), or pick another column.")
        completion = r.get(cols.completion, "")
        if not completion.strip():
            raise ZLError(f"{at_row(path, line)}: column {cols.completion!r} is empty (no completion); every row needs "
                          "one. Fill in or delete the row.")
        if cols.prompt_template is not None:
            fields = template_fields(cols.prompt_template)
            if not any(r.get(f, "").strip() for f in fields):
                raise ZLError(f"{at_row(path, line)}: the template's columns {', '.join(fields)} are all empty (no "
                              "prompt). Fill in or delete the row.")
            prompt = render_template(cols.prompt_template, {f: r.get(f, "") for f in fields})
        else:
            prompt = r.get(cols.prompt, "")
            if not prompt.strip():
                raise ZLError(f"{at_row(path, line)}: column {cols.prompt!r} is empty (no prompt). Fill in or delete "
                              "the row.")
        rows.append((line, prompt, completion))
    return rows
