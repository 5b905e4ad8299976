"""The readout translator (zl_export/translator.py): identity start, lens start, and their errors.

    .venv/bin/python -m pytest tests/test_translator.py
"""

import pytest
import torch

from zl_base.errors import ZLError
from zl_export.exporter import build_stage_modules
from zl_export.model_source import load_model
from zl_export.options import ExportOptions, LossConfig
from zl_export.stages import parse_spec
from zl_export.translator import ReadoutTranslator, fit_lenses

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rows(n: int = 6, seq: int = 24) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 250, (n, seq), generator=gen)
    mask = torch.ones(n, seq, dtype=torch.long)
    mask[0, seq // 2:] = 0
    return [(ids[:3], mask[:3]), (ids[3:], mask[3:])]


def test_identity_start_changes_nothing():
    t = ReadoutTranslator(16, 4, seed=1)
    u = torch.randn(3, 16)
    torch.testing.assert_close(t(u), u)


def test_a_full_rank_lens_start_is_the_lens_itself():
    lens = torch.eye(16) + 0.3 * torch.randn(16, 16, generator=torch.Generator().manual_seed(2))
    t = ReadoutTranslator(16, 16, seed=1)
    t.start_from(lens)
    u = torch.randn(5, 16)
    torch.testing.assert_close(t(u), u @ lens, rtol=1e-4, atol=1e-5)
    low = ReadoutTranslator(16, 4, seed=1)
    low.start_from(lens)  # the best rank-4 map around the identity: closer than the identity, not exact
    err = lambda m: float((m(u) - u @ lens).norm())  # noqa: E731
    assert 1e-3 < err(low) < float((u - u @ lens).norm())


def test_lenses_fit_the_last_layer_better_than_the_identity():
    loaded = load_model("tiny-random")
    opts = ExportOptions(loss=LossConfig(alpha=(1.0,), translator_rank=8))
    _, modules = build_stage_modules(loaded.model, parse_spec("0-0,1-2,3-3", 4), opts)
    rows = _rows()
    lenses = fit_lenses(modules, rows)
    assert sorted(lenses) == [0, 1]
    with torch.no_grad():
        for k, lens in lenses.items():
            x, y = [], []
            for ids, mask in rows:
                h = ids
                for m in modules:
                    _, h = m.chunk(h, mask)
                    if m.stage.index == k:
                        x.append(m.norm(h)[mask.bool()])
                y.append(modules[-1].norm(h)[mask.bool()])
            x, y = torch.cat(x), torch.cat(y)
            assert float((x @ lens - y).norm()) < 0.9 * float((x - y).norm()), k


def test_lens_start_reaches_the_modules_and_bad_settings_are_errors():
    loaded = load_model("tiny-random")
    hidden = loaded.config.hidden_size
    split = parse_spec("0-1,2-3", 4)
    lens_opts = ExportOptions(loss=LossConfig(alpha=(1.0,), translator_rank=hidden, translator_init="lens"))
    peft_model, modules = build_stage_modules(loaded.model, split, lens_opts, _rows())
    assert modules[0].translator.up.abs().max() > 0, "the lens start is not the identity"
    peft_model.unload()
    with pytest.raises(ZLError, match="needs calibration rows"):
        build_stage_modules(loaded.model, split, lens_opts)
    loaded.model = load_model("tiny-random").model
    too_big = ExportOptions(loss=LossConfig(translator_rank=hidden + 1))
    with pytest.raises(ZLError, match=f"--translator-rank {hidden + 1}: more than the model's hidden size {hidden}"):
        build_stage_modules(loaded.model, split, too_big)
