"""Settings trees (zl_base/settings.py) and the typer options generated from them (zl/options.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from zl_base.errors import ZLError
from zl.options import settings_command
from zl_base.settings import check_choices, flag, leaves, nested, setting
from zl_device.run.train_settings import TrainSettings
from zl_export.data_settings import DataSettings
from zl_export.options import ExportOptions, LoraSettings, LossConfig, ModelSplit


@dataclass(frozen=True)
class Inner:
    ratio: float = setting(0.5, "A float.")
    stage_lr: tuple[float, ...] = setting((1.0, 1.0), "Per-stage factors, e.g. 1,1,2.")
    ranks: tuple[int, ...] | None = setting(None, "Optional ints.")

    def validate(self) -> None:
        check_choices(self)


@dataclass(frozen=True)
class Outer:
    count: int = setting(3, "An int.")
    name: str | None = setting(None, "An optional str.")
    kind: str = setting("a", "A choice.", choices=("a", "b"))
    fast: bool = setting(True, "A bool with --fast/--no-fast.")
    out: Path = setting(Path("runs/x"), "A path.", flag="--out-dir")
    inner: Inner = nested(Inner)
    hidden: int = setting(7, "Not an option.", cli=False)


def _invoke(args: list[str]):
    seen = []
    app = typer.Typer()
    app.command("run")(settings_command(Outer, seen.append, "Run it.\n\nExample: run --count 2"))
    app.command("other")(lambda: None)
    result = CliRunner().invoke(app, ["run", *args], terminal_width=200)
    return result, seen


def test_defaults_come_from_the_fields():
    result, seen = _invoke([])
    assert result.exit_code == 0, result.output
    assert seen == [Outer()]


def test_every_type_round_trips_through_the_command_line():
    result, seen = _invoke(["--count", "5", "--name", "n", "--kind", "b", "--no-fast", "--out-dir", "o",
                            "--ratio", "0.25", "--stage-lr", "1, 1,2", "--ranks", "4,8"])
    assert result.exit_code == 0, result.output
    assert seen == [Outer(5, "n", "b", False, Path("o"), Inner(0.25, (1.0, 1.0, 2.0), (4, 8)))]
    assert "--hidden" not in _invoke(["--help"])[0].stdout


def test_help_shows_every_option_with_its_help():
    out = _invoke(["--help"])[0].stdout
    for leaf in leaves(Outer):
        assert leaf.flag.split("/")[0] in out and leaf.help in out, leaf.name
    assert "--no-fast" in out and "Example: run --count 2" in out


def test_bad_values_are_one_line_errors_naming_the_flag():
    result, _ = _invoke(["--stage-lr", "1,x"])
    assert isinstance(result.exception, ZLError)
    assert str(result.exception) == "--stage-lr 1,x: expected comma-separated float values, e.g. --stage-lr 0.3,0.7,1.0."
    with pytest.raises(ZLError, match=r"^--kind 'c': expected one of a, b\.$"):
        check_choices(Outer(kind="c"))


def _at_most_9(value: int, name: str) -> None:
    if value > 9:
        raise ZLError(f"{name} {value}: at most 9; pass {name} 9 or less.")


def test_a_setting_s_check_runs_with_the_flag_in_check_fields():
    from zl_base.settings import check_fields

    @dataclass(frozen=True)
    class Checked:
        count: int = setting(3, "An int of at most 9.", check=_at_most_9, flag="--how-many")
        inner: Inner = nested(Inner)

    check_fields(Checked())
    with pytest.raises(ZLError, match=r"^--how-many 12: at most 9; pass --how-many 9 or less\.$"):
        check_fields(Checked(count=12))


def test_shared_options_carry_their_checks_into_every_tree():
    """--seq-len, --stages and --devices are checked wherever they are declared, before any model or file."""
    from zl.commands.export import ExportArgs

    for bad, problem in [(TrainSettings(rows=DataSettings(seq_len=10**8)), "^--seq-len 100000000: at most 8192"),
                         (TrainSettings(split=ModelSplit(stages="")), "^--stages '': an empty stage spec"),
                         (TrainSettings(split=ModelSplit(num_stages=0)), "^--num-stages 0: needs at least 1 stage"),
                         (TrainSettings(devices="local:65"), "^--devices local:65: at most 64 local devices"),
                         (ExportArgs(options=ExportOptions(seq_len=10**8)), "^--seq-len 100000000: at most 8192"),
                         (ExportArgs(split=ModelSplit(stages=" ")), "^--stages ' ': an empty stage spec"),
                         (ExportArgs(out=Path(__file__)), "--out .*: a file, not a directory")]:
        with pytest.raises(ZLError, match=problem):
            bad.validate()


def test_export_and_train_keep_their_flags_and_defaults():
    assert [leaf.flag for leaf in leaves(ExportOptions)] == [
        "--seq-len", "--micro-batch", "--lora-rank", "--lora-alpha", "--lora-targets", "--alpha", "--consistency",
        "--first-target", "--gate", "--translator-rank", "--translator-init", "--loss", "--seed", "--frozen-dtype",
        "--embedding-dtype", "--max-targets", "--recompute/--no-recompute"]
    assert ExportOptions() == ExportOptions(128, 1, LoraSettings(8, 16.0, None), LossConfig((1.0,), "kl_rev", translator_rank=32), 0)
    flags = [leaf.flag for leaf in leaves(TrainSettings)]
    assert flags.count("--seq-len") == flags.count("--seed") == 1  # the run's own, not the export's
    assert {"--model", "--stages", "--num-stages", "--alpha", "--consistency", "--lora-rank", "--timeout", "--format -f",
            "--truncate/--no-truncate", "--prompt-column", "--prompt-template", "--micro-batch", "--window", "--samples"} <= set(flags)
    assert flag(LoraSettings, "rank") == "--lora-rank" and flag(ModelSplit, "num_stages") == "--num-stages"
    s = TrainSettings()
    assert (s.split.model, s.window, s.samples, s.rows.seq_len, s.export.loss.alpha, s.timeout_s) == (
        "smollm2-135m", 4, 256, None, (1.0,), 3600.0)
    assert s.export_options(64) == ExportOptions(seq_len=64)
    assert s.export_options(64, 32) == ExportOptions(seq_len=64, max_targets=32)


def test_target_slots_default_and_full_readout():
    assert ExportOptions().target_slots == 16 and ExportOptions(max_targets=3).target_slots == 3
    assert ExportOptions(max_targets=0).target_slots == 0
    # a sample of seq_len S has at most S - 1 targets: that many slots or more is the full readout
    assert ExportOptions(seq_len=16).target_slots == 0 and ExportOptions(seq_len=18).target_slots == 16


@pytest.mark.parametrize("opts, problem", [
    (ExportOptions(loss=LossConfig(alpha=0.0)), r"^--alpha 0: .*must lie in \(0, 1\]"),
    (ExportOptions(loss=LossConfig(alpha=(0.5, 1.2))), r"^--alpha 0.5,1.2: "),
    (ExportOptions(loss=LossConfig(consistency="kl")), r"^--consistency 'kl': expected one of kl_rev, kl_fwd"),
    (ExportOptions(loss=LossConfig(first_target="stage")), r"^--first-target 'stage': expected one of embedding, none"),
    (ExportOptions(loss=LossConfig(gate="soft")), r"^--gate 'soft': expected one of none, target_prob"),
    (ExportOptions(loss=LossConfig(translator_rank=-1)), r"^--translator-rank -1: "),
    (ExportOptions(loss=LossConfig(preset="mine")), r"^--loss 'mine': expected one of paper"),
    (ExportOptions(lora=LoraSettings(rank=0)), r"^--lora-rank 0: "),
    (ExportOptions(seq_len=1), r"^--seq-len 1: "),
    (ExportOptions(seq_len=8193), r"^--seq-len 8193: at most 8192 tokens per sample"),
    (ExportOptions(max_targets=-1), r"^--max-targets -1: "),
])
def test_each_dataclass_validates_its_own_fields(opts, problem):
    with pytest.raises(ZLError, match=problem):
        opts.validate()


@pytest.mark.parametrize("args, problem", [
    (["export", "--alpha", "0.3,0.7"], "--alpha 0.3,0.7: 2 values for 3 stages; give one value for every stage or exactly 3."),
    (["export", "--alpha", "1.5", "--stages", "0-1,2-3"], "--alpha 1.5: α weighs CE against KL and must lie in (0, 1]"),
    (["train", "--alpha", "0.5,0.5", "--stages", "0-9,10-19,20-29"], "--alpha 0.5,0.5: 2 values for 3 stages"),
    (["train", "--stage-lr", "1,2", "--num-stages", "3"], "--stage-lr 1,2: 2 values for 3 stages"),
    (["train", "--stage-lr", "1,-0.5,1"], "--stage-lr 1,-0.5,1: learning-rate multipliers must be 0 (the stage does not train) or positive"),
    (["train", "--stage-lr", "0,0,0"], "--stage-lr 0,0,0: learning-rate multipliers must be 0 (the stage does not train) or positive, and at least one positive"),
    (["train", "--gate", "soft"], "--gate 'soft': expected one of none, target_prob."),
    (["export", "--translator-rank", "-2"], "--translator-rank -2: must be 0"),
])
def test_bad_loss_options_exit_2_with_one_line(tmp_path, args, problem):
    """Per-stage values are checked against the stage count before any model is loaded (issue 9)."""
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run([sys.executable, "-m", "zl.cli", *args, "--out", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and problem in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "out").exists(), "a refused run leaves nothing behind"


def test_loss_paper_is_the_papers_loss_whatever_else_is_given():
    from zl_export.options import PAPER_LOSS

    paper = LossConfig(alpha=(1.0,), gate="target_prob", first_target="none", translator_rank=16, preset="paper")
    assert {k: getattr(paper, k) for k in PAPER_LOSS} == PAPER_LOSS
    assert LossConfig.from_manifest(paper.to_manifest()) == paper
    result = CliRunner().invoke(_export_app(), ["export", "--loss", "paper", "--translator-rank", "8"])
    assert result.exit_code == 0, result.output
    assert _seen_export[-1].options.loss.translator_rank == 0


_seen_export: list = []


def _export_app():
    from zl.commands.export import ExportArgs

    app = typer.Typer()
    app.command("export")(settings_command(ExportArgs, _seen_export.append, "Export."))
    app.command("other")(lambda: None)
    return app


@dataclass(frozen=True)
class _WithNewOption(ExportOptions):
    """ExportOptions with one more field, as the next export option will be declared: nothing else changes."""

    new_option: int = setting(0, "An export option added after the manifest and the cache key were written.")


def test_a_new_export_option_reaches_the_manifest_and_the_cache_key():
    """The export cache key hashes the options' serialization, so a new field changes it (issue 23: a hand-written
    key left a new option out, and a run with another value reused a stale export)."""
    from zl_device.executorch.export_cache import export_key

    run = TrainSettings(split=ModelSplit("tiny-random"))
    assert export_key(run, _WithNewOption(new_option=1)) != export_key(run, _WithNewOption(new_option=2))
    assert export_key(run, _WithNewOption()) == export_key(run, _WithNewOption())
    recorded = _WithNewOption(new_option=3, max_targets=8).to_manifest()
    assert recorded["new_option"] == 3
    assert _WithNewOption.from_manifest({"model": {}, "stages": [], **recorded}) == _WithNewOption(new_option=3,
                                                                                                    max_targets=8)


def test_an_export_another_run_finished_first_is_kept_and_ours_dropped(tmp_path, monkeypatch):
    """Two runs (or test processes) of the same options export side by side into one cache: the second to finish
    keeps the first's export, which that run may be reading, instead of deleting it under it; an unusable one (a
    program missing) is replaced."""
    from manifest_fixtures import fake_manifest
    from zl_device.executorch import export_cache
    from zl_export import pipeline
    from zl_export.manifest import write_manifest

    def write_export(folder: Path, marker: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        write_manifest(fake_manifest([(0, 1), (2, 3)]), folder)
        for k in (0, 1):
            (folder / f"stage_{k}.pte").write_bytes(b"")
        (folder / "who").write_text(marker)

    run = TrainSettings(split=ModelSplit("tiny-random"), export_cache=tmp_path / "cache")
    opts = ExportOptions()
    target = tmp_path / "cache" / export_cache.export_key(run, opts)
    finish_first = [True]

    class Exported:
        def __init__(self, out: Path):
            if finish_first[0]:  # the other run completes the same export meanwhile
                write_export(target, "theirs")
            write_export(out, "ours")
            self.exported = fake_manifest([(0, 1), (2, 3)])

    monkeypatch.setattr(pipeline, "export_pipeline", lambda split, out, *a, **kw: Exported(out))
    got, _ = export_cache.export_cached(run, opts, load=lambda: None, say=lambda m: None)
    assert got == target and (target / "who").read_text() == "theirs"
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # our temporary folder is gone
    (target / "stage_1.pte").unlink()  # unusable now: exported again, ours replaces it
    finish_first[0] = False
    got, _ = export_cache.export_cached(run, opts, load=lambda: None, say=lambda m: None)
    assert (target / "who").read_text() == "ours" and [p.name for p in target.parent.iterdir()] == [target.name]


def test_export_options_round_trip_through_the_manifest():
    """Every field is written by its name and read back; the manifest's notes (lora.dropout, loss.calibration) and
    other keys are left aside; a manifest from before --frozen-dtype is fp32."""
    opts = ExportOptions(seq_len=64, micro_batch=2, lora=LoraSettings(4, 8.0, ("q_proj", "o_proj")),
                         loss=LossConfig(alpha=(0.5, 1.0), gate="target_prob"), seed=3, frozen_dtype="int8",
                         max_targets=4)
    manifest = {"format_version": 1, "model": {"name": "tiny-random"}, "stages": [], **opts.to_manifest()}
    manifest["lora"]["dropout"], manifest["loss"]["calibration"] = 0.0, {"path": "demo"}
    assert ExportOptions.from_manifest(manifest) == opts
    del manifest["frozen_dtype"]
    assert ExportOptions.from_manifest(manifest).frozen_dtype == "fp32"
    assert ExportOptions(max_targets=None).to_manifest()["max_targets"] == 16  # what the programs have


def test_the_optimizer_defaults_live_in_one_node():
    """`zl train`'s stage configs, the eager references and the backprop baseline take AdamW's settings and the
    schedule from OptimizerSettings; a stage config reads back to the same settings."""
    from zl_device.torch import eager_training
    from zl_device.formats.lr_schedule import OptimizerSettings

    assert eager_training.OptimizerSettings is OptimizerSettings
    from zl_device.run.resolved_run import run_stage_specs

    s = TrainSettings(schedule="zerolock")
    assert s.optimizer == OptimizerSettings() and run_stage_specs(s)[2].lr == OptimizerSettings().lr
    assert [leaf.flag for leaf in leaves(OptimizerSettings)] == ["--lr"]
    two_windows = s.optimizer.for_windows(2)
    assert two_windows.schedule == {"kind": "warmup_cosine", "warmup_steps": 1, "min_lr_ratio": 0.1}
    assert OptimizerSettings.from_config(two_windows.config(0.25)) == replace(two_windows, lr=0.25)
    assert OptimizerSettings.from_config({}).schedule == {"kind": "constant"}  # the runner's own defaults


def test_every_command_takes_its_options_from_a_settings_tree():
    """No command declares options by hand: each is generated from a tree (zl/options.py), so a flag, its default
    and its help are declared once, and trees shared between commands (DataSettings) stay shared."""
    import importlib
    import pkgutil

    import zl.commands

    commands = {}
    for info in pkgutil.iter_modules(zl.commands.__path__):
        commands.update(importlib.import_module(f"zl.commands.{info.name}").COMMANDS)
    assert {"train", "export", "data", "devices", "deploy", "pull", "report", "merge", "eval", "generate"} <= set(commands)
    by_hand = sorted(name for name, fn in commands.items() if not hasattr(fn, "settings"))
    assert not by_hand, f"options declared by hand in: {by_hand}"
    from zl_export.options import DEFAULT_MODEL

    assert commands["data"].settings().model == DEFAULT_MODEL
    data_flags = {leaf.flag for leaf in leaves(commands["data"].settings)}
    assert {leaf.flag for leaf in leaves(DataSettings)} <= data_flags & {leaf.flag for leaf in leaves(TrainSettings)}


def test_required_options_and_arguments_come_from_the_tree():
    from zl_base.settings import REQUIRED

    @dataclass(frozen=True)
    class Args:
        where: Path = setting(REQUIRED, "A required path.", flag="--where -w")
        names: tuple[str, ...] | None = setting(None, "Names.", argument="NAMES...")
        count: int = setting(1, "A count.")

    seen = []
    app = typer.Typer()
    app.command("run")(settings_command(Args, seen.append, "Run."))
    app.command("other")(lambda: None)
    result = CliRunner().invoke(app, ["run", "a", "b", "-w", "x"])
    assert result.exit_code == 0, result.output
    assert seen == [Args(Path("x"), ("a", "b"), 1)]
    result = CliRunner().invoke(app, ["run", "a"])
    assert result.exit_code == 2 and "--where" in result.output
    assert flag(Args, "names") == "NAMES..." and flag(Args, "where") == "--where"
