"""What shapes an export: the model and its split, LoRA, the local loss, fixed shapes and the seed.

One settings tree (zl/settings.py) for `zl export` and `zl train`: each field
declares its default, flag and help; each class validates its own fields.
Torch-free, so the CLI builds its options without loading torch. To add an
option, add a field with `setting(default, "help")` here (see zl/settings.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from zl.errors import ZLError
from zl.settings import flag, nested, setting

DEFAULT_MODEL = "smollm2-135m"
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONSISTENCY_KINDS = ("kl_rev", "kl_fwd")


@dataclass(frozen=True)
class ModelSplit:
    """Which model, cut into which stages."""

    model: str = setting(DEFAULT_MODEL, "Built-in name (smollm2-135m, tinyllama-random, tiny-random), Hugging Face "
                                        "hub id, model directory or .gguf file.")
    stages: str | None = setting(None, "Layer ranges per stage, e.g. 0-6,7-13,14-21 (inclusive, consecutive, "
                                       "covering every layer).")
    num_stages: int = setting(3, "Balanced split into this many stages (used when --stages is not given).")

    def ranges(self, num_layers: int) -> list:
        """The stage ranges for a model of `num_layers` layers. Raises ZLError for a bad spec or count."""
        from zl_export.stages import balanced_split, parse_spec

        return parse_spec(self.stages, num_layers) if self.stages else balanced_split(num_layers, self.num_stages)

    @property
    def key(self) -> str:
        """The split as the export cache key records it: the spec, or balanced:N."""
        return self.stages or f"balanced:{self.num_stages}"


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA adapters every stage trains."""

    rank: int = setting(8, "LoRA rank r.", flag="--lora-rank")
    alpha: float = setting(16.0, "LoRA scaling α (the update is scaled by α/r).", flag="--lora-alpha")
    targets: tuple[str, ...] = setting(("q_proj", "v_proj"), "Comma-separated Llama projections that get adapters.",
                                       flag="--lora-targets")

    def validate(self) -> None:
        if self.rank < 1:
            raise ZLError(f"--lora-rank {self.rank}: the rank must be at least 1 (typical: 4-64).")
        if self.alpha <= 0:
            raise ZLError(f"--lora-alpha {self.alpha}: must be positive (typical: 2 x rank).")
        if not self.targets:
            raise ZLError("--lora-targets is empty; name at least one of " + ",".join(LLAMA_LINEARS) + ".")
        unknown = [t for t in self.targets if t not in LLAMA_LINEARS]
        if unknown:
            raise ZLError(
                f"--lora-targets {','.join(self.targets)}: {','.join(unknown)} is not a Llama projection; "
                f"choose from {','.join(LLAMA_LINEARS)}."
            )


@dataclass(frozen=True)
class LossConfig:
    """The local loss (zl_export/local_loss.py): α weights CE against the consistency (KL) term."""

    alpha: float = setting(0.5, "Weight of CE against KL in the local loss, in (0, 1].")
    consistency: str = setting("kl_rev", "KL direction: kl_rev = KL(p_k‖p_k-1) (the paper's Eq. 5) or kl_fwd.",
                               choices=CONSISTENCY_KINDS)

    def validate(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ZLError(f"{flag(LossConfig, 'alpha')} {self.alpha}: α weighs CE against KL and must lie in (0, 1]; "
                          "the paper uses 0.5.")
        if self.consistency not in CONSISTENCY_KINDS:
            raise ZLError(f"--consistency {self.consistency!r}: choose kl_rev (KL(p_k‖p_k-1), the paper's) or kl_fwd.")


@dataclass(frozen=True)
class ExportOptions:
    """Everything besides the model and the stage split that shapes the programs."""

    seq_len: int = setting(128, "Tokens per sample; programs have fixed shapes.")
    micro_batch: int = setting(1, "Samples per micro-batch.")
    lora: LoraSettings = nested(LoraSettings)
    loss: LossConfig = nested(LossConfig)
    seed: int = setting(0, "Seeds the LoRA initialisation (and random-weight models).")

    def validate(self, max_positions: int | None = None) -> None:
        if self.seq_len < 2:
            raise ZLError(f"--seq-len {self.seq_len}: needs at least 2 tokens (one input, one target).")
        if max_positions is not None and self.seq_len > max_positions:
            raise ZLError(
                f"--seq-len {self.seq_len}: longer than the model's {max_positions} positions; use --seq-len {max_positions} or less."
            )
        if self.micro_batch < 1:
            raise ZLError(f"--micro-batch {self.micro_batch}: must be at least 1.")
        self.loss.validate()
        self.lora.validate()
