"""What shapes an export: the model and its split, LoRA, the local loss, fixed shapes and the seed.

One settings tree (zl_base/settings.py) for `zl export` and `zl train`: each field
declares its default, flag and help; each class validates its own fields.
Torch-free, so the CLI builds its options without loading torch. To add an
option, add a field with `setting(default, "help")` here (see zl_base/settings.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from zl_base.errors import ZLError
from zl_base.settings import check_fields, flag, from_json, nested, setting, to_json
from zl_export.model_family import check_lora_names

DEFAULT_MODEL = "smollm2-135m"
CONSISTENCY_KINDS = ("kl_rev", "kl_fwd")
FIRST_TARGETS = ("embedding", "none")
GATES = ("none", "target_prob")
TRANSLATOR_INITS = ("identity", "lens")
# How the frozen weights are stored in a program (zl_export/frozen_weights.py, docs/design#frozen-weights).
FROZEN_DTYPES = ("fp32", "bf16", "int8", "int4")
# Target slots per sample when --max-targets is not given and no data is at hand (`zl export`): classification
# completions (label word + EOS, the demo task and AG News: 1-3 tokens) fit with room to spare.
DEFAULT_MAX_TARGETS = 16
# `zl train` fits the slots to its training data: its largest target count rounded up to a multiple of this, so
# similar data shares one cached export while the readout stays within a few positions of what the loss needs.
TARGET_SLOT_STEP = 4
# What a stage program computes (docs/design#backprop-program): ZeroLock's local step, or a link of end-to-end backprop.
PROGRAM_KINDS = ("zerolock", "backprop")
# The longest --seq-len any command takes, checked before anything is tokenized or allocated: the longest context
# of the built-in models (SmolLM2-135M: 8192 positions; TinyLlama 2048, tiny-random 512), and already far beyond
# what a phone stage trains on (its attention scores alone are heads x S^2 float32: 9 x 8192^2 x 4 B = 2.4 GB for
# SmolLM2). A loaded model's own max_position_embeddings is checked too (`ExportOptions.validate`).
MAX_SEQ_LEN = 8192
# `--loss paper`: the local loss exactly as the ZeroLock paper writes it (Eq. 5), whatever the defaults are.
PAPER_LOSS = {"alpha": (0.5,), "consistency": "kl_rev", "first_target": "embedding", "gate": "none",
              "translator_rank": 0, "translator_init": "identity"}


def check_seq_len(seq_len: int | None, name: str = "--seq-len") -> None:
    """Raise ZLError unless `seq_len` (None: the default) is 2 to MAX_SEQ_LEN tokens; `name` is the flag."""
    if seq_len is None:
        return
    if seq_len < 2:
        raise ZLError(f"{name} {seq_len}: needs at least 2 tokens (one input, one target), e.g. {name} 128.")
    if seq_len > MAX_SEQ_LEN:
        raise ZLError(f"{name} {seq_len}: at most {MAX_SEQ_LEN} tokens per sample (the longest context of the "
                      f"built-in models); pass {name} {MAX_SEQ_LEN} or less, e.g. {name} 128.")


def check_stage_spec(spec: str | None, name: str = "--stages") -> None:
    """An empty --stages is a mistake (None means "not given": a balanced split); the full check needs the layer
    count (`stages.parse_spec`)."""
    if spec is not None and not spec.strip():
        raise ZLError(f"{name} {spec!r}: an empty stage spec; give layer ranges like {name} 0-6,7-13,14-21, or drop "
                      f"{name} for a balanced split into --num-stages stages.")


def check_num_stages(count: int, name: str = "--num-stages") -> None:
    """Raise ZLError for fewer than 1 stage (more stages than layers needs the model: `stages.balanced_split`)."""
    if count < 1:
        raise ZLError(f"{name} {count}: needs at least 1 stage (1: the whole model on one device). Use {name} 1 or "
                      "more (the default is 3).")


@dataclass(frozen=True)
class ModelSplit:
    """Which model, cut into which stages."""

    model: str = setting(DEFAULT_MODEL, "Built-in name (smollm2-135m, gemma3-270m, tinyllama-random, tiny-random, "
                                        "tiny-random-qwen2|qwen3|phi3|gemma3), Hugging Face hub id, model directory "
                                        "or .gguf file (Llama, Qwen2/2.5, Qwen3, Phi-3 or Gemma 3 text models).")
    stages: str | None = setting(None, "Layer ranges per stage, e.g. 0-6,7-13,14-21 (inclusive, consecutive, "
                                       "covering every layer); or a plan file from `zl plan` (plan.json); zl train "
                                       "also takes `auto` (plan the split on the devices first).",
                                 check=check_stage_spec)
    num_stages: int = setting(3, "Balanced split into this many stages (used when --stages is not given); 1: the "
                                 "whole model on one device, the baseline a pipeline is measured against.",
                              check=check_num_stages)

    def validate(self) -> None:
        """The checks that need no model (the layer count checks the rest in `ranges`)."""
        check_fields(self)

    def ranges(self, num_layers: int) -> list:
        """The stage ranges for a model of `num_layers` layers. Raises ZLError for a bad spec or count."""
        from zl_export.stages import balanced_split, parse_spec

        return parse_spec(self.stages, num_layers) if self.stages else balanced_split(num_layers, self.num_stages)

    @property
    def count(self) -> int:
        """How many stages the split has, known before the model is loaded (per-stage options are checked on it)."""
        return len([r for r in self.stages.split(",") if r.strip()]) if self.stages else self.num_stages

    @property
    def key(self) -> str:
        """The split as the export cache key records it: the spec, or balanced:N."""
        return self.stages or f"balanced:{self.num_stages}"

    @property
    def chosen_by_default(self) -> bool:
        """No layer ranges given: `zl train` may choose them (zl_device/run/default_split.py). A split whose ranges
        are its own (a calibration round's, zl_device/plan/calibrate.py) says False."""
        return self.stages is None


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA adapters every stage trains."""

    rank: int = setting(8, "LoRA rank r.", flag="--lora-rank")
    alpha: float = setting(16.0, "LoRA scaling α (the update is scaled by α/r).", flag="--lora-alpha")
    # None: the model family's default (`ModelFamily.default_lora_targets`), known once the model is loaded; a
    # model-independent default would name projections some family lacks (Phi-3 fuses q/k/v into qkv_proj).
    targets: tuple[str, ...] | None = setting(None, "Comma-separated projections that get adapters: "
                                              "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj (Llama, "
                                              "Qwen, Gemma 3); qkv_proj,o_proj,gate_up_proj,down_proj (Phi-3). "
                                              "Default: every one of the family's.", flag="--lora-targets")

    def for_family(self, family) -> "LoraSettings":
        """These settings with the targets of `family` (a `ModelFamily`) filled in when none were given."""
        if self.targets is not None:
            return self
        return LoraSettings(self.rank, self.alpha, family.default_lora_targets)

    def validate(self, family=None) -> None:
        """Raises ZLError for a bad rank, α or target; `family` (a `ModelFamily`, once the model is known) checks
        the targets against its projections, else they must be a projection of some supported family (targets
        not given are the family's default, valid by construction)."""
        if self.rank < 1:
            raise ZLError(f"--lora-rank {self.rank}: the rank must be at least 1 (typical: 4-64).")
        if self.alpha <= 0:
            raise ZLError(f"--lora-alpha {self.alpha}: must be positive (typical: 2 x rank).")
        if self.targets is None:
            return
        if family is None:
            check_lora_names(tuple(self.targets))
        else:
            family.check_lora_targets(tuple(self.targets))


@dataclass(frozen=True)
class LossConfig:
    """The local loss of every stage (zl_export/local_loss.py), recorded in `manifest.json` under "loss".

    The defaults (α 1 with rank-32 readout translators) are the best variant of the accuracy study
    (tools/accuracy_study.py; docs/studies/README.md, agnews-smollm2-135m-readouts); `--loss paper` gives the
    paper's form.
    """

    alpha: tuple[float, ...] = setting((1.0,), "CE weight α of the local loss against its KL term, in (0, 1]: one "
                                               "value for every stage, or one per stage (e.g. 0.3,0.7,1.0); at 1 "
                                               "there is no KL term (the paper: 0.5).")
    consistency: str = setting("kl_rev", "KL direction: kl_rev = KL(p_k‖p_k-1) (the paper's Eq. 5) or kl_fwd.",
                               choices=CONSISTENCY_KINDS)
    first_target: str = setting("embedding", "What stage 0's KL term points at: the readout of the token "
                                             "embeddings (the paper's) or none (stage 0 trains on CE alone).",
                                choices=FIRST_TARGETS)
    gate: str = setting("none", "Weight of the KL term per position: none (the paper's) or target_prob (the "
                                "previous readout's probability of the target: follow it only where it is right).",
                        choices=GATES)
    translator_rank: int = setting(32, "Rank of a trainable readout translator (diagonal + low-rank map in front of "
                                       "the frozen LM head) on every stage but the last; 0 = the paper's plain "
                                       "readout.")
    translator_init: str = setting("identity", "How a readout translator starts: identity, or lens (a tuned lens: "
                                               "the least-squares map from the stage's hidden state to the last "
                                               "layer's, fitted at export on calibration rows).",
                                   choices=TRANSLATOR_INITS)
    preset: str | None = setting(None, "paper: the paper's loss (α 0.5, KL(p_k‖p_k-1), stage 0 towards the "
                                       "embedding readout, no gate, no translator); overrides the loss options above.",
                                 flag="--loss", choices=("paper",))

    def __post_init__(self) -> None:
        if self.preset == "paper":
            for name, value in PAPER_LOSS.items():
                object.__setattr__(self, name, value)
        # α as one number is accepted too (Python callers; manifests written before per-stage α).
        alpha = self.alpha
        object.__setattr__(self, "alpha", (float(alpha),) if isinstance(alpha, (int, float))
                           else tuple(float(a) for a in alpha))

    def alpha_of(self, stage: int) -> float:
        """α of stage `stage` (the single value when one is given for all stages)."""
        return self.alpha[0] if len(self.alpha) == 1 else self.alpha[stage]

    def validate(self, num_stages: int | None = None) -> None:
        """Raises ZLError naming the option, the value seen and the fix; `num_stages` checks α's count."""
        shown = ",".join(f"{a:g}" for a in self.alpha)
        name = flag(LossConfig, "alpha")
        if not self.alpha or not all(0.0 < a <= 1.0 for a in self.alpha):
            raise ZLError(f"{name} {shown}: α weighs CE against KL and must lie in (0, 1] (one value, or one per "
                          "stage); the paper uses 0.5.")
        if num_stages is not None and len(self.alpha) not in (1, num_stages):
            raise ZLError(f"{name} {shown}: {len(self.alpha)} values for {num_stages} stages; give one value for "
                          f"every stage or exactly {num_stages}.")
        check_fields(self)
        if self.translator_rank < 0:
            raise ZLError(f"{flag(LossConfig, 'translator_rank')} {self.translator_rank}: must be 0 (no translator) "
                          "or a rank of at least 1 (e.g. 32).")

    def to_manifest(self) -> dict:
        """A manifest's "loss": every field (`ExportOptions.to_manifest`)."""
        return to_json(self)

    @classmethod
    def from_manifest(cls, loss: dict) -> "LossConfig":
        """The config a manifest's "loss" records (older manifests: alpha as a number and consistency only)."""
        return from_json(cls, loss, "manifest.json loss", others=True)


def frozen_storage(frozen_dtype: str, embedding_dtype: str | None) -> str:
    """`--frozen-dtype` and `--embedding-dtype` as the report and `zl plan` print them: `int4`, or `int4, embedding
    and head bf16`."""
    same = embedding_dtype in (None, frozen_dtype)
    return frozen_dtype if same else f"{frozen_dtype}, embedding and head {embedding_dtype}"


def check_local_weight(weight: float, name: str = "--local-weight") -> None:
    """Raise ZLError unless --local-weight is 0 or positive and finite."""
    if not (0.0 <= weight < float("inf")):
        raise ZLError(f"{name} {weight}: must be 0 (no local loss: the program holds no readout) or a "
                      "positive weight of the local loss added to the end-to-end one, e.g. 0.1.")


@dataclass(frozen=True)
class ProgramSettings:
    """Which program every stage gets (docs/design#backprop-program); recorded in manifest.json under "program"."""

    kind: str = setting("zerolock", "What each stage program computes: zerolock (its local loss, the runner's "
                                    "programs) or backprop (takes the gradient of its output hidden state, "
                                    "grad_hidden, and gives its LoRA gradients and its input's, grad_input: a link of "
                                    "end-to-end backprop; the last stage's loss is the true CE).",
                        flag="--program", choices=PROGRAM_KINDS)
    local_weight: float = setting(0.0, "--program backprop: weight w of each upstream stage's local loss added to "
                                       "its end-to-end objective; 0 (default) leaves the readout (LM head) out of "
                                       "the upstream programs.", check=check_local_weight)

    def validate(self) -> None:
        """Raises ZLError for an unknown kind, a bad weight, or a weight without the backprop program."""
        check_fields(self)
        if self.local_weight and self.kind != "backprop":
            raise ZLError(f"--local-weight {self.local_weight:g}: only the backprop program adds a weighted local "
                          "loss (the zerolock program trains on the local loss alone); add --program backprop or "
                          "drop --local-weight.")

    def to_manifest(self) -> dict:
        """The manifest's "program": {"kind", "local_weight"}."""
        return to_json(self)


@dataclass(frozen=True)
class ExportOptions:
    """Everything besides the model and the stage split that shapes the programs."""

    seq_len: int = setting(128, f"Tokens per sample (2 to {MAX_SEQ_LEN}); programs have fixed shapes.",
                           check=check_seq_len)
    micro_batch: int = setting(1, "Samples per micro-batch.")
    lora: LoraSettings = nested(LoraSettings)
    loss: LossConfig = nested(LossConfig)
    seed: int = setting(0, "Seeds the LoRA initialisation (and random-weight models).")
    frozen_dtype: str = setting("bf16", "How the frozen weights (projections, LM head, embedding) are stored: bf16 "
                                        "(half the bytes of fp32, as accurate on AG News), fp32, int8 with a "
                                        "float32 scale per output channel, or int4 with a float16 scale and "
                                        "minimum per 32 input channels (0.31x fp32's bytes); widened to "
                                        "float32 per use. LoRA weights, gradients and AdamW state stay "
                                        "float32.",
                                choices=FROZEN_DTYPES)
    embedding_dtype: str | None = setting(None, "How the token embedding and the LM head (tied or not) are stored, "
                                                "when not as --frozen-dtype: `--frozen-dtype int4 --embedding-dtype "
                                                "bf16` keeps the layers at int4's bytes and the vocabulary's tables "
                                                "at bf16's accuracy (SmolLM2 on headlines: int4 everywhere costs "
                                                "+1.2% NLL, this brings it level; the tables then take 2 bytes a "
                                                "weight instead of 0.625 on the stages holding them). Default: as "
                                                "--frozen-dtype.",
                                          choices=FROZEN_DTYPES)
    max_targets: int | None = setting(None, f"Target tokens per sample the programs read out (the LM head runs on "
                                            f"these slots only); 0 reads out every position. Default: "
                                            f"{DEFAULT_MAX_TARGETS}; `zl train`: its training data's largest target "
                                            f"count, rounded up to {TARGET_SLOT_STEP}.")
    recompute: bool = setting(False, "Activation recomputation: the programs keep each layer's input, not its "
                                     "activations, through the forward and compute the layer again in the "
                                     "backward (the same gradients; less memory, a longer step). ExecuTorch "
                                     "programs only; the torch runtime keeps the activations.")

    @property
    def frozen_storage(self) -> str:
        """How the frozen weights are stored, as reports print it (`frozen_storage`)."""
        return frozen_storage(self.frozen_dtype, self.embedding_dtype)

    @property
    def target_slots(self) -> int:
        """T, the target slots per sample the programs have: --max-targets, else the default.

        0 means the full readout; so does any T >= seq_len - 1 (a sample has at most seq_len - 1 targets, and
        reading out that many slots costs as much as reading out every position).
        """
        slots = DEFAULT_MAX_TARGETS if self.max_targets is None else self.max_targets
        return 0 if slots >= self.seq_len - 1 else slots

    def to_manifest(self) -> dict:
        """The options as manifest.json records them, every field by its name (nested trees as objects), with
        `max_targets` resolved to the programs' `target_slots`.

        What the export cache key hashes (zl_device/executorch/export_cache.py) and `from_manifest` reads back, so a new
        field reaches the manifest, the cache key and the rebuilt options without a line elsewhere.
        """
        return {**to_json(self), "max_targets": self.target_slots}

    @classmethod
    def from_manifest(cls, manifest: dict) -> "ExportOptions":
        """The options of an export, from its manifest (`to_manifest`'s keys; the manifest's other keys and notes,
        like "model", "stages" or lora's "dropout", are left aside). A manifest from before --frozen-dtype is fp32."""
        picked = {f.name: manifest[f.name] for f in fields(cls) if f.name in manifest}
        return from_json(cls, {"frozen_dtype": "fp32", **picked}, "manifest.json", others=True)

    def validate(self, max_positions: int | None = None) -> None:
        check_fields(self)  # --seq-len's range, the choices
        if max_positions is not None and self.seq_len > max_positions:
            raise ZLError(
                f"--seq-len {self.seq_len}: longer than the model's {max_positions} positions; use --seq-len {max_positions} or less."
            )
        if self.micro_batch < 1:
            raise ZLError(f"--micro-batch {self.micro_batch}: must be at least 1.")
        if self.max_targets is not None and self.max_targets < 0:
            raise ZLError(f"--max-targets {self.max_targets}: must be 0 (read out every position) or a number of "
                          f"target slots per sample, e.g. {DEFAULT_MAX_TARGETS}.")
        self.loss.validate()
        self.lora.validate()
