"""Shared fixtures. Tests run on CPU with tiny random Llama models unless marked slow."""

import os
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep the model cache out of the user's home, but share it across tests (GGUF conversion is slow)."""
    if "ZL_CACHE_DIR" not in os.environ:
        monkeypatch.setenv("ZL_CACHE_DIR", str(Path.home() / ".cache" / "zl"))


def load_tool(name: str):
    """tools/<name>.py as a module (the tools are scripts, not a package)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def write_demo_data(out: Path) -> Path:
    """`zl data --demo --model tiny-random --out OUT`: OUT/train.safetensors and OUT/dev.safetensors (label words)."""
    import typer
    from typer.testing import CliRunner

    from zl.commands.data import data_command

    app = typer.Typer(add_completion=False)
    app.command("data")(data_command)  # a one-command app: typer takes no command name
    result = CliRunner().invoke(app, ["--demo", "--model", "tiny-random", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> Path:
    """`zl data --demo --model tiny-random`: OUT/train.safetensors and OUT/dev.safetensors (label words), once per
    test module."""
    return write_demo_data(tmp_path_factory.mktemp("demo"))


def widen_chunks(monkeypatch, elements: int) -> None:
    """Frozen weights of every dtype stored and widened in row chunks of <= `elements` (zl_export/frozen_weights.py's
    CHUNK_ELEMENTS and INT4_CHUNK_ELEMENTS)."""
    from zl_export import frozen_weights

    monkeypatch.setattr(frozen_weights, "CHUNK_ELEMENTS", elements)
    monkeypatch.setattr(frozen_weights, "INT4_CHUNK_ELEMENTS", elements)


def native_library_or_skip() -> None:
    """Skip when the marker kernel is not built (run `bash setup.sh`)."""
    from custom_ops.runtime import DEFAULT_PATH, ENV_VAR

    path = Path(os.environ.get(ENV_VAR, DEFAULT_PATH))
    if not path.is_file():
        pytest.skip(f"{path} not built; run `bash setup.sh` (or set {ENV_VAR})")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models' kernels take microseconds; on a shared 2-core machine extra intra-op threads only spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def brute_force_label_scores(model, shard) -> tuple[float, float]:
    """Reference for label-word scoring: accuracy from the full logits of prompt + each label word (summed
    log-probs of its tokens), NLL from the model's own loss over the label tokens."""
    cands = shard.meta["label_token_ids"]
    correct = 0
    with torch.no_grad():
        for i in range(shard.rows):
            n = int(shard.attention_mask[i].sum())
            p = int((shard.labels[i] != -100).nonzero()[0])
            prompt = shard.input_ids[i, :p].tolist()
            truth = cands.index(shard.input_ids[i, p : n - 1].tolist())
            scores = []
            for c in cands:
                logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + c])).logits[0].float(), -1)
                scores.append(sum(float(logp[p - 1 + j, t]) for j, t in enumerate(c)))
            correct += int(max(range(len(cands)), key=scores.__getitem__) == truth)
        loss = model(input_ids=shard.input_ids, attention_mask=shard.attention_mask, labels=shard.labels).loss
    return correct / shard.rows, float(loss)


def fake_v1(tmp_path: Path) -> Path:
    """A cgroup v1 cpu controller folder for tests of the CPU-quota code: the files it writes, empty."""
    root = tmp_path / "cpu"
    root.mkdir()
    for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us", "cgroup.procs"):
        (root / name).write_text("")
    return root
