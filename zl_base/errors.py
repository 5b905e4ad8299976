"""The one error type for user mistakes.

Every message says what was wrong, the value seen, what was expected and how
to fix it. The CLI prints it as one line; `ZL_DEBUG=1` adds the traceback.
"""


class ZLError(Exception):
    """A user-facing error: bad input, a missing file or device, a bad setting."""


def read_json_file(path, label: str, *, missing: str, invalid: str):
    """The JSON value in the file at `path` (a `pathlib.Path`).

    Args:
        label: how the error names the file, e.g. "manifest runs/x/manifest.json".
        missing: the fix when there is no such file; invalid: the fix when it is not valid JSON.

    Raises:
        ZLError: "<label>: no such file; <missing>" or "<label>: not valid JSON (<why>, line N); <invalid>".
    """
    import json

    if not path.is_file():
        raise ZLError(f"{label}: no such file; {missing}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ZLError(f"{label}: not valid JSON ({e.msg}, line {e.lineno}); {invalid}") from e
    except UnicodeDecodeError as e:
        raise ZLError(f"{label}: not a text file ({e.reason} at byte {e.start}); {invalid}") from e
