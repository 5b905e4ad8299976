"""Tokenizers behind one small interface.

Real models bring their own tokenizer (Hugging Face); the random-weight models
(`tiny-random`, `tinyllama-random`) use `ByteTokenizer`, which needs no files:
their weights mean nothing, so any consistent mapping of text to ids will do.

Every sample starts as the model was pretrained to read text: with the beginning-of-sequence (BOS) token exactly
when the tokenizer adds one by default. Gemma and Llama 2 (TinyLlama) tokenizers do, and their models depend on
it (gemma3-270m pays 6.18 nats per token on an English sentence without `<bos>`, 2.85 with it); SmolLM2's does
not (its `<|im_start|>` is a BOS token it never adds), nor does the byte tokenizer. `HFTokenizer` asks the
tokenizer once and records the answer as `bos_token_id`; `encode_prompt` is the one place that puts it in front
of text, for `zl data`/`zl train` shards (and so `zl eval` and the accuracy study, which read them) and
`zl generate` prompts alike.
"""

from typing import Protocol


class Tokenizer(Protocol):
    """What `zl data`, `zl eval` and `zl generate` need from a tokenizer."""

    name: str
    eos_token_id: int
    pad_token_id: int
    bos_token_id: int | None  # the id every sample starts with (see encode_prompt); None: the tokenizer adds none
    vocab_size: int  # ids are 0 .. vocab_size - 1 (special tokens included): what a shard for it may hold

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens: a piece of a sample (a completion, a label word). A
        sample's start goes through `encode_prompt`."""
        ...

    def decode(self, ids: list[int]) -> str:
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; 256 is end of sequence, 257 padding."""

    name = "bytes"
    eos_token_id = 256
    pad_token_id = 257
    bos_token_id = None  # no BOS: the random models' weights mean nothing, and shards of them stay as they were
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer; padding falls back to end-of-sequence when the model has no pad token, and
    `bos_token_id` is the BOS the tokenizer adds by default (`default_bos`), else None."""

    def __init__(self, tok, name: str):
        self._tok = tok
        self.name = name
        if tok.eos_token_id is None:
            from zl_base.errors import ZLError

            raise ZLError(f"tokenizer {name!r} has no end-of-sequence token; zl needs one to end completions")
        self.eos_token_id = int(tok.eos_token_id)
        self.pad_token_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_token_id
        self.bos_token_id = default_bos(tok)
        self.vocab_size = len(tok)  # with the added special tokens (tok.vocab_size counts the base vocabulary only)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str | None:
        """`messages` rendered by the model's chat template with the assistant's turn opened (the text the model
        continues), or None when the tokenizer has no chat template. Used by `zl_export.chat`."""
        if not getattr(self._tok, "chat_template", None):
            return None
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def save(self, directory: str) -> None:
        self._tok.save_pretrained(directory)


def default_bos(tok) -> int | None:
    """The BOS id the Hugging Face tokenizer `tok` puts before text by default, or None when it puts none.

    Asked of the tokenizer's behaviour, not of a setting: `add_bos_token` is absent or wrong on some fast tokenizers
    (Gemma 3's says False while its post-processor adds `<bos>`), and a BOS token may exist without being added
    (SmolLM2's `<|im_start|>`). So one character is encoded with and without special tokens: the tokenizer adds a
    BOS when the first adds exactly its `bos_token_id` in front of the second.
    """
    bos = tok.bos_token_id
    if bos is None:
        return None
    plain = list(tok("a", add_special_tokens=False)["input_ids"])
    full = list(tok("a")["input_ids"])
    return int(bos) if full[:1] == [bos] and full[1 : 1 + len(plain)] == plain else None


def bos_ids(tokenizer: Tokenizer) -> list[int]:
    """[BOS id] for a tokenizer that starts samples with one, else []: the head of a sample that truncation keeps.
    A tokenizer without the attribute (a test's stand-in) adds none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return [] if bos is None else [bos]


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids a sample (or a generation prompt) starts with: the tokenizer's BOS when it adds one by default, then
    `text` encoded.

    A prompt rendered by a chat template may already begin with the BOS as text (Gemma's and Llama 2's templates
    write `{{ bos_token }}`; the tokenizer reads it as the BOS id), and then it is not doubled: every sample holds
    it once, in front.
    """
    ids = tokenizer.encode(text)
    head = bos_ids(tokenizer)
    return ids if not head or ids[:1] == head else head + ids


def without_bos(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """`ids` without the leading BOS `encode_prompt` put there: the prompt's own text, for showing it."""
    head = bos_ids(tokenizer)
    return ids[1:] if head and ids[:1] == head else ids
