"""File helpers every layer uses."""

import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    """The sha256 of the file at `path`, read in 1 MiB blocks, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
