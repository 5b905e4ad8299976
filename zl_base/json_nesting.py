"""How deeply a JSON text nests, in time linear in its length: checked before `json.loads`, which recurses once per
level (a RecursionError past ~1,000), by every reader of untrusted JSON (control frames, JSONL data files).
"""

import re

import numpy as np

# A JSON string, closed or not (an unclosed one runs to the end of the text). The possessive quantifiers keep the
# match from backtracking, so stripping every string is one pass over the text: the same pattern without them is
# quadratic on an unclosed string of escaped quotes (issue 28, then issue 43 in the JSONL reader: `{"` + 33 `[` +
# 16,000 `\"` took 3.9 s, a 1 MB line about an hour).
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"?', re.DOTALL)
_STEP = np.zeros(256, np.int8)  # byte -> its change of nesting depth outside strings
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def nests_deeper_than(text: "str | bytes", limit: int) -> bool:
    """Whether the arrays/objects of the JSON `text` nest deeper than `limit` levels (brackets inside strings do not
    count). Exact for valid JSON; for any other text the answer does not matter, as json.loads rejects it anyway."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    skeleton = np.frombuffer(_STRING.sub(b"", raw), np.uint8)  # (N,) the bytes outside strings
    if skeleton.size == 0:
        return False
    return int(np.cumsum(_STEP[skeleton], dtype=np.int64).max()) > limit
