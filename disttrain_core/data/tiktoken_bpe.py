"""A tiktoken BPE file (Llama 3's ``tokenizer.model``), read through the ``tiktoken`` package.

The file holds one token a line, ``<base64 of the token's bytes> <rank>``; the rank is both the token's id and its
merge priority (a lower rank merges first). The file carries neither the pre-tokenization regex nor the special
tokens, so they are Llama 3's: ``LLAMA3_PATTERN`` and 256 special tokens from the vocabulary's size upward
(``llama3_special_tokens``; 128000-128255 for Llama 3's 128000 ranks).
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from .tokenizer_files import (
    AUDIO_TOKEN,
    GEN_TOKEN,
    IMAGE_TOKEN,
    TIKTOKEN_LINE,
    VIDEO_TOKEN,
    placeholder_names,
    special_ids,
    tokenizer_file,
)

# Llama 3's pre-tokenizer: contractions (any case), a word with at most one leading non-letter, numbers in runs of
# up to three digits, punctuation runs with their line breaks, then whitespace.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
LLAMA3_SPECIAL_COUNT = 256
# Offsets from the vocabulary's size of the named special tokens; every other offset is reserved, numbered from 0.
LLAMA3_NAMED = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "<|eot_id|>",
}


def llama3_special_tokens(vocabulary: int) -> dict[str, int]:
    """Llama 3's 256 special tokens and their ids, the first at ``vocabulary`` (the number of ranks)."""
    reserved = iter(range(LLAMA3_SPECIAL_COUNT))
    names = [
        LLAMA3_NAMED.get(offset) or f"<|reserved_special_token_{next(reserved)}|>"
        for offset in range(LLAMA3_SPECIAL_COUNT)
    ]
    return {name: vocabulary + offset for offset, name in enumerate(names)}


def _bad(name: str, file: Path, what: str) -> ValueError:
    return ValueError(f"data.tokenizer={name}: {file} {what}; fix the file or use data.tokenizer=<tokenizer.json>")


def read_ranks(name: str, file: Path) -> dict[bytes, int]:
    """``token bytes -> rank`` of a tiktoken file. Raises a one-line ValueError at the first malformed line, a
    repeated token, ranks that are not 0 to n-1 each once, or a missing single byte (text it could not encode)."""
    ranks: dict[bytes, int] = {}
    with open(file, "rb") as handle:
        for number, line in enumerate(handle, 1):
            line = line.rstrip(b"\r\n")
            if not line:
                continue
            if not TIKTOKEN_LINE.fullmatch(line):
                raise _bad(name, file, f"line {number} is not '<base64 token> <rank>' ({line[:60]!r})")
            encoded, rank = line.split(b" ")
            try:
                token = base64.b64decode(encoded, validate=True)
            except binascii.Error:
                raise _bad(name, file, f"line {number}: {encoded[:60]!r} is not valid base64") from None
            if token in ranks:
                raise _bad(name, file, f"line {number} repeats the token {token!r} of rank {ranks[token]}")
            ranks[token] = int(rank)
    count = len(ranks)
    absent = set(range(count)) - set(ranks.values())
    if absent:
        rule = f"ranks run from 0 to {count - 1}, once each"
        raise _bad(name, file, f"has {count} tokens but no rank {min(absent)}: {rule}")
    lacking = [value for value in range(256) if bytes([value]) not in ranks]
    if lacking:
        missing = f"the single byte 0x{lacking[0]:02x} ({len(lacking)} of 256 absent)"
        raise _bad(name, file, f"lacks {missing}: text holding it has no id")
    return ranks


class TiktokenTokenizer:
    """A tiktoken BPE file with Llama 3's regex and special tokens, behaving as ``HFTokenizer`` does.

    bos/eos/pad: a ``tokenizer_config.json`` beside the file, else the well-known names (``<|begin_of_text|>`` and
    ``<|end_of_text|>``; pad falls back to eos). ``<image>``, ``<gen>`` (and ``<audio>``/``<video>`` with
    ``audio``/``video``) are added after the 256 special tokens; ``added`` lists them. ``encode`` reads special-token
    text as plain text; ``decode`` drops every special id. Pickling keeps the path and the flags.
    """

    def __init__(self, path: str | Path, audio: bool = False, video: bool = False):
        self.path = str(path)
        self.audio, self.video = bool(audio), bool(video)
        file = tokenizer_file(self.path)
        try:
            import tiktoken
        except ImportError:
            raise ValueError(
                f"data.tokenizer={self.path}: {file} is a tiktoken BPE file, and the tiktoken package is not "
                "installed; pip install -r requirements.txt (it pins tiktoken)"
            ) from None
        ranks = read_ranks(self.path, file)
        special = llama3_special_tokens(len(ranks))
        self._mergeable, self._named, self._ranks = ranks, special, len(ranks)
        self.bos_id, self.eos_id, self.pad_id = special_ids(self.path, file, self.token_to_id)
        self.added = [token for token in placeholder_names(self.audio, self.video) if self.token_to_id(token) is None]
        for token in self.added:
            special[token] = len(ranks) + len(special)
        self.image_id, self.gen_id = self.token_to_id(IMAGE_TOKEN), self.token_to_id(GEN_TOKEN)
        self.audio_id = self.token_to_id(AUDIO_TOKEN) if self.audio else -1
        self.video_id = self.token_to_id(VIDEO_TOKEN) if self.video else -1
        self.encoding = tiktoken.Encoding(
            name=f"llama3:{file.name}", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=special
        )
        self.vocab_size = self.encoding.n_vocab
        self._special = {self.pad_id, self.bos_id, self.eos_id, self.image_id, self.gen_id, self.audio_id}
        self._special.add(self.video_id)

    def token_to_id(self, token: str) -> int | None:
        """A special token's id, else the rank of the token's UTF-8 bytes; None when the file has neither."""
        return self._named.get(token, self._mergeable.get(token.encode("utf-8")))

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_template(self, text: str) -> list[int]:
        """A chat template's own text: the special tokens it spells (``<|eot_id|>``) are their ids."""
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        """Text only: special tokens (ids from the vocabulary's size) and our special ids are dropped."""
        return self.encoding.decode([i for i in ids if i < self._ranks and i not in self._special])

    def __reduce__(self):
        return TiktokenTokenizer, (self.path, self.audio, self.video)

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.path!r}, vocab_size={self.vocab_size})"
