"""Shards: the tokenized samples stage 0 and `zl eval` read, and their JSON sidecar.

`NAME.safetensors` holds `input_ids`, `attention_mask`, `labels`, int64
[N, S] (docs/design#stage-program conventions, see zl_export.data); `NAME.json` next to it
says how they were made (see `write_shard`), among it the BOS id the rows start
with (`Shard.bos_token_id`, checked against the model's tokenizer by `check_matches`).
"""

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zl_base.errors import ZLError
from zl_base.json_reader import read_json_file
from zl_base.files import file_sha256

if TYPE_CHECKING:
    from zl_export.tokenizer import Tokenizer

SHARD_FORMAT_VERSION = 1
TENSOR_NAMES = ("input_ids", "attention_mask", "labels")


def sidecar_path(shard: Path | str) -> Path:
    """`DIR/train.safetensors` -> `DIR/train.json`."""
    return Path(shard).with_suffix(".json")


def write_shard(path: Path | str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write the three int64 [N, S] `tensors` to `path` (.safetensors) and `meta` to its sidecar.

    Both files are written under a temporary name and renamed, the tensors
    first, so a sidecar never describes a half-written shard. `meta` gets
    `format_version`, `rows` and `seq_len` from the tensors.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows, seq_len = tensors["input_ids"].shape
    meta = {"format_version": SHARD_FORMAT_VERSION, "rows": int(rows), "seq_len": int(seq_len), **meta}
    tmp = path.with_name(path.name + ".tmp")
    save_file({n: tensors[n].contiguous() for n in TENSOR_NAMES}, str(tmp), metadata={"zl_shard": str(SHARD_FORMAT_VERSION)})
    os.replace(tmp, path)
    side = sidecar_path(path)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, side)


@dataclass
class Shard:
    """A loaded shard: three int64 [N, S] tensors and the sidecar."""

    path: Path
    input_ids: torch.Tensor  # (N, S)
    attention_mask: torch.Tensor  # (N, S)
    labels: torch.Tensor  # (N, S)
    meta: dict

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def label_words(self) -> list[str] | None:
        return self.meta.get("label_words")

    def micro_batches(self, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """Consecutive micro-batches of `batch_size` rows, in shard order.

        The last partial batch is dropped: stage programs are exported for a
        fixed batch size, so every micro-batch must have exactly that many rows.

        Raises:
            ZLError: batch_size < 1 or larger than the shard.
        """
        if batch_size < 1 or batch_size > self.rows:
            raise ZLError(
                f"micro-batch size {batch_size} does not fit shard {self.path} with {self.rows} rows; "
                f"expected 1..{self.rows}. Lower the micro-batch size or prepare more rows."
            )
        for start in range(0, self.rows - batch_size + 1, batch_size):
            end = start + batch_size
            yield {n: getattr(self, n)[start:end] for n in TENSOR_NAMES}

    def check_target_slots(self, slots: int) -> None:
        """Raise ZLError naming the first row with more than `slots` target tokens (0: no limit)."""
        check_target_slots(self.labels, slots, lambda i: f"shard {self.path} row {i}")

    @property
    def bos_token_id(self) -> int | None:
        """The BOS id every row starts with, or None. A sidecar written before zl prepended BOS has no such key,
        and its rows have none: for a tokenizer that adds no BOS (SmolLM2, the byte tokenizer) such a shard is
        exactly what zl makes today, for one that does (Gemma) it is stale."""
        return self.meta.get("tokenizer", {}).get("bos_token_id")

    def check_token_ids(self, vocab_size: int, tokenizer_name: str) -> None:
        """Raise ZLError naming the first token id outside 0 .. vocab_size - 1: in `input_ids`, or in `labels`
        other than -100 (no target). Such an id is an IndexError in the embedding or the loss (`zl eval`), or
        trips the runner's bounds check again and again (`zl train`), so it is refused before any work."""
        for name, ids in (("input_ids", self.input_ids), ("labels", self.labels)):  # (N, S) each
            bad = (ids < 0) | (ids >= vocab_size)
            if name == "labels":
                bad &= ids != -100
            count = int(bad.sum())
            if count:
                row, position = divmod(int(bad.flatten().to(torch.uint8).argmax()), self.seq_len)
                more = f" ({count - 1:,} more such ids)" if count > 1 else ""
                raise ZLError(f"shard {self.path}: {name} row {row} position {position} holds token id "
                              f"{int(ids[row, position])}, outside the {vocab_size:,} ids of the tokenizer of "
                              f"{tokenizer_name} (0 to {vocab_size - 1:,}){more}; the shard is damaged or was not made "
                              f"for this model. Rebuild it with `zl data ... --model {tokenizer_name}`.")

    def check_matches(self, seq_len: int | None = None, tokenizer_name: str | None = None,
                      tokenizer: "Tokenizer | None" = None) -> None:
        """Raise ZLError when the shard was built for another seq_len or tokenizer than a program expects.

        `tokenizer` (the model's) checks its name, every token id against its vocabulary (`check_token_ids`), and
        that the rows start with its BOS exactly when it adds one (`zl_export.tokenizer.encode_prompt`): a Gemma
        shard made before zl added `<bos>` must be remade, while a SmolLM2 one stays valid, since nothing changed
        for it. `tokenizer_name` checks the name alone.
        """
        if seq_len is not None and seq_len != self.seq_len:
            raise ZLError(
                f"shard {self.path} has seq_len {self.seq_len}, the program expects {seq_len}. "
                f"Rebuild the data with `zl data ... --seq-len {seq_len}`."
            )
        if tokenizer is not None and tokenizer_name is None:
            tokenizer_name = tokenizer.name
        built = self.meta.get("tokenizer", {}).get("name")
        if tokenizer_name is not None and built != tokenizer_name:
            raise ZLError(
                f"shard {self.path} was tokenized for {built!r}, the model uses {tokenizer_name!r}. "
                f"Rebuild the data with `zl data ... --model {tokenizer_name}`."
            )
        if getattr(tokenizer, "vocab_size", None) is not None:
            self.check_token_ids(tokenizer.vocab_size, tokenizer.name)
        want = getattr(tokenizer, "bos_token_id", None)
        if tokenizer is not None and self.bos_token_id != want:
            has = "no beginning-of-sequence token" if self.bos_token_id is None else f"BOS id {self.bos_token_id}"
            needs = "none" if want is None else f"BOS id {want}"
            raise ZLError(
                f"shard {self.path}: its rows start with {has}, the tokenizer of {tokenizer.name} starts samples with "
                f"{needs}{' (the shard predates zl adding it)' * (self.bos_token_id is None)}. Rebuild the data with "
                f"`zl data ... --model {tokenizer.name}`."
            )


def target_counts(labels: torch.Tensor) -> torch.Tensor:
    """(N,) int64: target tokens per row (labels other than -100 after the first position: Ω of
    docs/design#local-loss)."""
    return (labels[:, 1:] != -100).sum(dim=1)


def target_slots_for(targets: int) -> int:
    """The target slots for samples of at most `targets` target tokens: the count rounded up to a multiple of
    TARGET_SLOT_STEP, so the readout runs on a few positions more than the loss needs at most, and similar data
    shares one cached export (`zl train` without --max-targets; AG News and the demo task: 4 slots)."""
    from zl_export.options import TARGET_SLOT_STEP

    return max(1, -(-targets // TARGET_SLOT_STEP)) * TARGET_SLOT_STEP


def fitted_target_slots(labels: torch.Tensor) -> tuple[int, int]:
    """(most target tokens of any row, `target_slots_for` them)."""
    need = int(target_counts(labels).max()) if len(labels) else 0
    return need, target_slots_for(need)


def check_target_slots(labels: torch.Tensor, slots: int, where: Callable[[int], str]) -> None:
    """Raise ZLError when a row has more target tokens than the programs' `slots` (0: no limit).

    A stage program reads out only the first `slots` targets of each sample (docs/design#omega-readout) and cannot tell
    that a sample had more, so this host-side check is what keeps targets from being dropped silently.

    Args:
        labels: (N, S) int64.
        slots: T, the programs' target slots per sample (`--max-targets`); 0 reads out every position.
        where: names row i for the message, e.g. "shard train.safetensors row 12" or "data.csv line 13".
    """
    if slots <= 0:
        return
    counts = target_counts(labels)
    over = (counts > slots).nonzero().flatten()
    if len(over):
        i, worst = int(over[0]), int(counts.max())
        others = len(over) - 1
        more = f" ({others} more {'row' if others == 1 else 'rows'} too)" if others else ""
        raise ZLError(f"{where(i)}: {int(counts[i])} target tokens, more than the programs' {slots} target slots"
                      f"{more}; pass --max-targets {worst} or more (0 reads out every position).")


def shard_meta(path: Path | str) -> dict:
    """A shard's sidecar (counts, tokenizer, label words, ...) without loading its tensors.

    Raises:
        ZLError: the sidecar is missing or not valid JSON.
    """
    side = sidecar_path(path)
    if not side.is_file():
        raise ZLError(f"shard {path}: its sidecar {side} is missing. Recreate the shard with `zl data`.")
    return read_json_file(side, f"shard sidecar {side}", missing="recreate the shard with `zl data`.",
                          invalid="recreate the shard with `zl data`.")


def load_shard(path: Path | str) -> Shard:
    """Load and validate a shard written by `write_shard`.

    Raises:
        ZLError: missing files, unreadable safetensors, missing tensors, wrong
            dtype or shape, or a sidecar that disagrees with the tensors.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        raise ZLError(f"shard {path} is a directory; pass the file, e.g. {path / 'train.safetensors'}.")
    if not path.is_file():
        raise ZLError(f"shard {path}: no such file. Create it with `zl data --input FILE --out {path.parent}`.")
    meta = shard_meta(path)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ZLError(f"shard {path}: not a readable safetensors file ({e}). Recreate it with `zl data`.") from e
    missing = [n for n in TENSOR_NAMES if n not in tensors]
    if missing:
        raise ZLError(f"shard {path}: tensors {', '.join(missing)} are missing (found {', '.join(tensors) or 'none'}).")
    shape = tuple(tensors["input_ids"].shape)
    for n in TENSOR_NAMES:
        t = tensors[n]
        if t.dtype != torch.int64:
            raise ZLError(f"shard {path}: tensor {n} is {t.dtype}, expected torch.int64. Recreate it with `zl data`.")
        if t.dim() != 2 or tuple(t.shape) != shape:
            raise ZLError(f"shard {path}: tensor {n} has shape {list(t.shape)}, expected [rows, seq_len] = {list(shape)}.")
    if meta.get("rows") != shape[0] or meta.get("seq_len") != shape[1]:
        raise ZLError(
            f"shard {path}: the sidecar says {meta.get('rows')} rows x {meta.get('seq_len')} tokens, the tensors are "
            f"{shape[0]} x {shape[1]}. The two files come from different runs; recreate the shard with `zl data`."
        )
    return Shard(path, tensors["input_ids"], tensors["attention_mask"], tensors["labels"], meta)
