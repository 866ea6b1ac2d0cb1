"""Tokenizers behind a small interface. The default is byte-level (no download):
ids 0-255 are UTF-8 bytes, followed by a few special tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    image_id: int  # placeholder replaced by one image patch embedding
    gen_id: int  # generation query token; its hidden state conditions the generator

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    pad_id: int = 256
    bos_id: int = 257
    eos_id: int = 258
    image_id: int = 259
    gen_id: int = 260
    vocab_size: int = 261

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


TOKENIZERS = {"byte": ByteTokenizer}


def build_tokenizer(name: str) -> Tokenizer:
    if name not in TOKENIZERS:
        raise ValueError(f"data.tokenizer={name!r} is unknown; available: {sorted(TOKENIZERS)}")
    return TOKENIZERS[name]()
