"""The one error type for user mistakes.

Every message says what was wrong, the value seen, what was expected and how
to fix it. The CLI prints it as one line; `ZL_DEBUG=1` adds the traceback.
"""


class ZLError(Exception):
    """A user-facing error: bad input, a missing file or device, a bad setting."""

