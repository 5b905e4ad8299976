"""Tokenizers behind one small interface.

Real models bring their own tokenizer (Hugging Face); the random-weight models
(`tiny-random`, `tinyllama-random`) use `ByteTokenizer`, which needs no files:
their weights mean nothing, so any consistent mapping of text to ids will do.
"""

from typing import Protocol


class Tokenizer(Protocol):
    """What `zl data` and `zl eval` need from a tokenizer."""

    name: str
    eos_token_id: int
    pad_token_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        ...

    def decode(self, ids: list[int]) -> str:
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; 256 is end of sequence, 257 padding."""

    name = "bytes"
    eos_token_id = 256
    pad_token_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer; padding falls back to end-of-sequence when the model has no pad token."""

    def __init__(self, tok, name: str):
        self._tok = tok
        self.name = name
        if tok.eos_token_id is None:
            from zl.errors import ZLError

            raise ZLError(f"tokenizer {name!r} has no end-of-sequence token; zl needs one to end completions")
        self.eos_token_id = int(tok.eos_token_id)
        self.pad_token_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_token_id

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
