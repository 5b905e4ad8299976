"""The accuracy study's arms: the ways of training it compares (`Arm`), the built-in ones (`ARMS`) and `--arm`'s
syntax (`parse_arm`).

An arm is base (the model without an adapter), backprop (LoRA over the whole model, end-to-end backprop),
backprop-last (LoRA on the last stage's layers only), async (whole-model backprop as PipeDream's asynchronous
schedule computes it: each stage on its stashed weight version) or zerolock (each stage on its local loss, with the loss
settings, per-stage lr multipliers, frozen dtype and LoRA settings it names). The built-in arms spell out every
loss field that differs from the paper's, so a change of `zl train`'s defaults changes only zl-default and
zl-all-stages (and, through the fingerprint, their cached results: zl_study/accuracy_study.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from zl_base.errors import ZLError
from zl_export.options import FROZEN_DTYPES, ExportOptions, LoraSettings, LossConfig


@dataclass(frozen=True)
class Arm:
    """One way of training: `kind` base | backprop | backprop-last | async | zerolock, with ZeroLock's loss settings."""

    name: str
    kind: str
    loss: dict = field(default_factory=dict)  # LossConfig fields (zerolock)
    stage_lr: tuple[float, ...] = (1.0,)  # learning-rate multiplier per stage (zerolock)
    note: str = ""
    frozen_dtype: str = "fp32"  # the frozen weights' storage, any kind (`--frozen-dtype`, docs/design#frozen-weights)
    lora: dict = field(default_factory=dict)  # LoraSettings fields that differ from the study's (zerolock)
    lr: float | None = None  # peak learning rate of this arm (None: the study's --lr), e.g. a stable one for backprop
    embedding_dtype: str | None = None  # the token embedding's and LM head's storage when not frozen_dtype's

    def loss_config(self) -> LossConfig:
        return LossConfig(**self.loss)

    def lora_settings(self, study: LoraSettings) -> LoraSettings:
        return dataclasses.replace(study, **self.lora)


# The built-in arms, every loss field that differs from the paper's spelled out (the defaults of `zl train` may
# change with the study's findings; an arm must not). zl-paper is the loss of the paper (`--loss paper`).
_PLAIN = {"translator_rank": 0}
ARMS = {a.name: a for a in (
    Arm("base", "base", note="no adapter"),
    Arm("backprop", "backprop", note="LoRA on every layer, end-to-end backprop"),
    Arm("backprop-last", "backprop-last", note="LoRA on the last stage's layers only, backprop"),
    Arm("async", "async", note="LoRA on every layer, end-to-end gradients on PipeDream's asynchronous schedule"),
    Arm("zl-paper", "zerolock", {"preset": "paper"},
        note="α 0.5, KL(p_k‖p_k-1), stage 0 towards the embedding readout"),
    Arm("zl-ce", "zerolock", {"alpha": (1.0,), **_PLAIN}, note="α 1: CE only"),
    Arm("zl-gated", "zerolock", {"alpha": (0.5,), "gate": "target_prob", "first_target": "none", **_PLAIN},
        note="α 0.5, KL gated by p_k-1(target), none for stage 0"),
    Arm("zl-translator", "zerolock", {"alpha": (1.0,), "translator_rank": 32},
        note="α 1, rank-32 readout translator on stages before the last"),
    Arm("zl-translator-gated", "zerolock", {"alpha": (0.5,), "gate": "target_prob", "first_target": "none",
                                            "translator_rank": 32},
        note="gated KL and rank-32 translators"),
    Arm("zl-lens", "zerolock", {"alpha": (1.0,), "translator_rank": 576, "translator_init": "lens"},
        note="α 1, full-rank readout translators started as tuned lenses (least squares on 64 training rows)"),
    Arm("zl-last-heavy", "zerolock", {"alpha": (1.0,), "translator_rank": 32}, stage_lr=(0.5, 0.5, 2.0),
        note="translators; lr ×0.5 on early stages, ×2 on the last"),
    Arm("zl-translator-bf16", "zerolock", {"alpha": (1.0,), "translator_rank": 32}, frozen_dtype="bf16",
        note="zl-translator with bf16 frozen weights"),
    Arm("zl-translator-int8", "zerolock", {"alpha": (1.0,), "translator_rank": 32}, frozen_dtype="int8",
        note="zl-translator with int8 frozen weights (a float32 scale per output channel)"),
)}


def _default_arm(name: str = "zl-default", stage_lr: tuple[float, ...] = (1.0,), what: str = "zl train's defaults",
                 ) -> Arm:
    """`zl train`'s defaults as an arm: every LossConfig field and the frozen dtype, as they are now (so its
    fingerprint, and its cached results, change when a default does)."""
    defaults = ExportOptions()
    loss = {f: getattr(defaults.loss, f) for f in LossConfig.__dataclass_fields__}
    lrs = "" if stage_lr == (1.0,) else f", stage lr {'/'.join(f'{m:g}' for m in stage_lr)}"
    return Arm(name, "zerolock", loss, stage_lr=stage_lr, frozen_dtype=defaults.frozen_dtype,
               embedding_dtype=defaults.embedding_dtype,
               note=f"{what}: α {','.join(f'{x:g}' for x in defaults.loss.alpha)}, translator rank "
                    f"{defaults.loss.translator_rank} ({defaults.loss.translator_init}), frozen weights "
                    f"{defaults.frozen_dtype}{lrs}")


def default_arm_for(arm: Arm, stages: int) -> Arm:
    """`arm`, or for zl-default the arm of `zl train`'s defaults on this split: its --stage-lr holds the stages
    before the last still (zl_device/run/train_settings.py default_stage_lr)."""
    from zl_device.run.train_settings import default_stage_lr

    if arm.name != _DEFAULT:
        return arm
    return _default_arm(stage_lr=default_stage_lr(stages))


ARMS[_DEFAULT := "zl-default"] = _default_arm()
ARMS["zl-all-stages"] = _default_arm("zl-all-stages", what="zl train's defaults with every stage training")
DEFAULT_ARMS = ("base", "backprop", "backprop-last", _DEFAULT)
REFERENCE_ARM = "backprop"


def parse_list(text: str, kind, flag: str) -> tuple:
    """"1,2" (or "1/2" inside --arm) -> (1, 2), parsed as the settings tree parses list options; at least one value."""
    from zl_base.settings import parse_list as parse_setting_list

    values = parse_setting_list(text.replace("/", ","), kind, flag)
    if not values:
        raise ZLError(f"{flag} {text!r}: give at least one value.")
    return values


#: zerolock: local losses; backprop: whole-model (synchronous, GPipe's result); backprop-last: the last stage only;
#: async: end-to-end backprop as PipeDream's asynchronous schedule computes it (zl_device/torch/stale_backprop.py).
TRAINED_KINDS = ("zerolock", "backprop", "backprop-last", "async")


def parse_arm(spec: str) -> Arm:
    """`NAME:key=value;key=value` with LossConfig fields, stage_lr, and lists as a/b/c (a ZeroLock arm); `kind=backprop`,
    `kind=backprop-last` or `kind=async` for a backprop arm, `lr=` for an arm's own peak learning rate (any kind)."""
    name, _, body = spec.partition(":")
    name = name.strip()
    if not name or name in ARMS:
        raise ZLError(f"--arm {spec!r}: give a new name before ':' (built-in arms: {', '.join(ARMS)}).")
    kind, lr, loss, stage_lr, frozen_dtype, embedding_dtype, lora = "zerolock", None, {}, (1.0,), "fp32", None, {}
    fields = LossConfig.__dataclass_fields__
    for item in filter(None, (p.strip() for p in body.split(";"))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise ZLError(f"--arm {spec!r}: {item!r} is not key=value.")
        if key == "kind":
            kind = value.strip()
            if kind not in TRAINED_KINDS:
                raise ZLError(f"--arm {spec!r}: kind {kind!r}; expected one of {', '.join(TRAINED_KINDS)}.")
        elif key == "lr":
            lr = parse_list(value, float, f"--arm {name} lr")[0]
            if not lr > 0:
                raise ZLError(f"--arm {spec!r}: lr {value.strip()} must be positive, e.g. lr=0.002.")
        elif key == "stage_lr":
            stage_lr = parse_list(value, float, f"--arm {name} stage_lr")
        elif key == "frozen_dtype":
            frozen_dtype = value.strip()
        elif key == "embedding_dtype":
            embedding_dtype = value.strip()
        elif key == "lora_targets":
            lora["targets"] = tuple(v.strip() for v in value.split("/") if v.strip())
        elif key == "lora_rank":
            lora["rank"] = parse_list(value, int, f"--arm {name} lora_rank")[0]
        elif key == "alpha":
            loss["alpha"] = parse_list(value, float, f"--arm {name} alpha")
        elif key == "translator_rank":
            loss["translator_rank"] = parse_list(value, int, f"--arm {name} translator_rank")[0]
        elif key in fields:
            loss[key] = value.strip()
        else:
            raise ZLError(f"--arm {spec!r}: unknown key {key!r}; use kind, lr, stage_lr, frozen_dtype, "
                          f"embedding_dtype, lora_targets, lora_rank or one of {', '.join(fields)}.")
    zerolock_only = [k for k, v in (("stage_lr", stage_lr != (1.0,)), ("loss fields", bool(loss))) if v]
    if kind != "zerolock" and zerolock_only:
        raise ZLError(f"--arm {spec!r}: {', '.join(zerolock_only)} set for a {kind} arm; they are ZeroLock settings "
                      f"(a backprop arm takes kind, lr, frozen_dtype, embedding_dtype, lora_targets and "
                      f"lora_rank).")
    arm = Arm(name, kind, loss, stage_lr, note=body, frozen_dtype=frozen_dtype, lora=lora, lr=lr,
              embedding_dtype=embedding_dtype)
    arm.lora_settings(LoraSettings()).validate()
    arm.loss_config().validate()
    for key, value in (("frozen_dtype", frozen_dtype), ("embedding_dtype", embedding_dtype)):
        if value is not None and value not in FROZEN_DTYPES:
            raise ZLError(f"--arm {spec!r}: {key} {value!r}; expected one of {', '.join(FROZEN_DTYPES)}.")
    return arm


def held_still(arm: Arm, stage: int, num_stages: int) -> bool:
    """Whether `arm` holds `stage` still (runs it forward only), by the runtimes' rule on its lr multiplier there."""
    from zl_device.formats.stage_spec import FORWARD, stage_role

    lr = arm.stage_lr[0 if len(arm.stage_lr) == 1 else stage]
    return stage_role(lr, stage, num_stages, "zerolock") == FORWARD


def without_held_exits(arm: Arm, result: dict) -> dict:
    """`result` with no early exit for the stages `arm` holds still (arms cached before they were left unscored
    have the base model's figures there, which say nothing about training)."""
    if not result.get("early_exit_nll"):
        return result
    return {**result, **{key: [None if held_still(arm, k, len(values)) else v for k, v in enumerate(values)]
                         for key in ("early_exit_nll", "early_exit_accuracy") if (values := result.get(key))}}
