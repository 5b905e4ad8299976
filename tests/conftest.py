"""Shared fixtures. Tests run on CPU with tiny random Llama models unless marked slow."""

import os
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep the model cache out of the user's home, but share it across tests (GGUF conversion is slow)."""
    if "ZL_CACHE_DIR" not in os.environ:
        monkeypatch.setenv("ZL_CACHE_DIR", str(Path.home() / ".cache" / "zl"))


def native_library_or_skip() -> None:
    """Skip when the marker kernel is not built (run `bash setup.sh`)."""
    from custom_ops.runtime import DEFAULT_PATH, ENV_VAR

    path = Path(os.environ.get(ENV_VAR, DEFAULT_PATH))
    if not path.is_file():
        pytest.skip(f"{path} not built; run `bash setup.sh` (or set {ENV_VAR})")
