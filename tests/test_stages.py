"""Stage specs: parsing, balanced splits, and the error for every kind of bad spec."""

import pytest

from zl_base.errors import ZLError
from zl_export.stages import balanced_split, format_spec, parse_spec


def test_tinyllama_paper_split():
    stages = parse_spec("0-6,7-13,14-21", 22)
    assert [(s.index, s.first, s.last, s.num_layers) for s in stages] == [(0, 0, 6, 7), (1, 7, 13, 7), (2, 14, 21, 8)]
    assert format_spec(stages) == "0-6,7-13,14-21"


def test_one_stage_is_the_whole_model_on_one_device():
    """The one-device baseline: `--stages 0-21` or `--num-stages 1` is one stage of every layer."""
    assert parse_spec("0-21", 22) == balanced_split(22, 1) == [parse_spec("0-21", 22)[0]]
    assert (balanced_split(22, 1)[0].first, balanced_split(22, 1)[0].last) == (0, 21)


def test_single_layer_ranges_and_spaces():
    assert format_spec(parse_spec(" 0 , 1-2 ,3", 4)) == "0-0,1-2,3-3"


@pytest.mark.parametrize(
    ("num_layers", "k", "sizes"),
    [(22, 3, [8, 7, 7]), (30, 3, [10, 10, 10]), (4, 4, [1, 1, 1, 1]), (5, 2, [3, 2])],
)
def test_balanced_split(num_layers, k, sizes):
    stages = balanced_split(num_layers, k)
    assert [s.num_layers for s in stages] == sizes
    assert parse_spec(format_spec(stages), num_layers) == stages  # a balanced split is a valid spec


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("0-6,8-13,14-21", "gap between stage 0"),
        ("0-7,7-13,14-21", "overlaps stage 0"),
        ("0-6,13-7,14-21", "descending"),
        ("0-6,7-13,14-22", "beyond the model's last layer 21"),
        ("0-6,,14-21", "empty stage range"),
        ("", "empty stage range"),
        ("0-6,7-13,14-x", "not of the form FIRST-LAST"),
        ("1-6,7-13,14-21", "layers 0-0 belong to no stage"),
        ("0-6,7-13,14-20", "layers 21-21 belong to no stage"),
        ("0-6,7-13-14", "not of the form FIRST-LAST"),
    ],
)
def test_bad_specs_name_the_problem_and_the_layer_count(spec, problem):
    with pytest.raises(ZLError) as e:
        parse_spec(spec, 22)
    message = str(e.value)
    assert problem in message
    assert "22 layers" in message
    assert repr(spec) in message


@pytest.mark.parametrize(("num_layers", "k", "problem"), [(22, 0, "at least 1 stage"), (4, 5, "only 4 layers")])
def test_bad_balanced_splits(num_layers, k, problem):
    with pytest.raises(ZLError, match=problem):
        balanced_split(num_layers, k)
