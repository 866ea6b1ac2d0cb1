"""Tokenizers behind a small interface.

* ``byte`` (the default, no download): ids 0-255 are UTF-8 bytes, followed by a few special tokens.
* any other ``data.tokenizer`` value is the path of a tokenizer file (or of the directory holding it), its format
  told by its content (``tokenizer_files``): a Hugging Face ``tokenizer.json``, read with the ``tokenizers``
  library (:class:`HFTokenizer`), or a tiktoken BPE file such as Llama 3's ``tokenizer.model``, read with the
  ``tiktoken`` package (``tiktoken_bpe.TiktokenTokenizer``). Both give the same ids for the same vocabulary.

``encode`` returns the ids of plain text only: the sample encoder (``samples.py``) adds ``<bos>``, ``<eos>``,
image and generation tokens itself, so text can never produce a special id.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .tiktoken_bpe import TiktokenTokenizer
from .tokenizer_files import (
    AUDIO_TOKEN,
    FIX,
    GEN_TOKEN,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    file_format,
    placeholder_names,
    special_ids,
    tokenizer_file,
)


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    image_id: int  # placeholder replaced by one image patch embedding
    gen_id: int  # generation query token; its hidden state conditions the generator
    audio_id: int  # placeholder replaced by one audio-encoder position (-1: this tokenizer has none)
    video_id: int  # placeholder replaced by one video-tower position (-1: this tokenizer has none)

    def encode(self, text: str) -> list[int]: ...

    def encode_template(self, text: str) -> list[int]: ...  # a chat template's text: its special tokens are ids

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    pad_id: int = 256
    bos_id: int = 257
    eos_id: int = 258
    image_id: int = 259
    gen_id: int = 260
    audio_id: int = 261
    video_id: int = 262
    vocab_size: int = 263

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_template(self, text: str) -> list[int]:
        return self.encode(text)  # no special tokens are spelled in text here

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``.

    Special ids: ``bos_token``/``eos_token``/``pad_token`` of a ``tokenizer_config.json`` in the same
    directory, else the first well-known name present (``BOS_NAMES``, ``EOS_NAMES``, ``PAD_NAMES``);
    pad falls back to eos, bos to eos. ``<image>`` and ``<gen>`` are looked up by name and added as special
    tokens when absent, so ``vocab_size`` (every id, added ones included) can exceed the file's by two:
    ``added`` lists what was added. ``<audio>`` is added only with ``audio=True`` (a model with an audio tower),
    so a text or image model's vocabulary does not move; without it ``audio_id`` is -1; ``<video>`` likewise with
    ``video=True`` (a model with a video tower). Pickling keeps the path and those flags, so a decode worker or
    another process rebuilds the same tokenizer from the same file.
    """

    def __init__(self, path: str | Path, audio: bool = False, video: bool = False):
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as Backend

        self.path = str(path)
        self.audio, self.video = bool(audio), bool(video)
        file = tokenizer_file(self.path)
        try:
            backend = Backend.from_file(str(file))
        except Exception as error:  # the Rust side raises a bare Exception for bad JSON or an unknown model
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ValueError(f"data.tokenizer={self.path}: not a readable tokenizer.json ({reason}); {FIX}") from None
        self.bos_id, self.eos_id, self.pad_id = special_ids(self.path, file, backend.token_to_id)
        self.added: list[str] = []
        for name in placeholder_names(self.audio, self.video):
            if backend.token_to_id(name) is None:
                backend.add_special_tokens([AddedToken(name, special=True, normalized=False)])
                self.added.append(name)
        self.image_id = backend.token_to_id(IMAGE_TOKEN)
        self.gen_id = backend.token_to_id(GEN_TOKEN)
        self.audio_id = backend.token_to_id(AUDIO_TOKEN) if self.audio else -1
        self.video_id = backend.token_to_id(VIDEO_TOKEN) if self.video else -1
        # Text is text: a caption containing "<image>" must not become an image placeholder.
        backend.encode_special_tokens = True
        # Added tokens may leave gaps in the id space: the model needs a row for the largest id.
        largest = max(backend.get_added_tokens_decoder(), default=-1)
        self.vocab_size = max(backend.get_vocab_size(with_added_tokens=True), largest + 1)
        self._backend = backend
        self._special = {self.pad_id, self.bos_id, self.eos_id, self.image_id, self.gen_id}
        self._special |= {self.audio_id, self.video_id}

    def token_to_id(self, token: str) -> int | None:
        """The id of a token of the file (added ones included); None when it has none."""
        return self._backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_template(self, text: str) -> list[int]:
        """A chat template's own text (data/conversations.py): the special tokens it spells (``<|im_start|>``) are
        the file's special ids, as transformers tokenizes a rendered template; data text never comes here."""
        self._backend.encode_special_tokens = False
        try:
            return self._backend.encode(text, add_special_tokens=False).ids
        finally:
            self._backend.encode_special_tokens = True

    def decode(self, ids: list[int]) -> str:
        """Text only, like ByteTokenizer: our special ids are dropped even when the file does not mark them so."""
        return self._backend.decode([i for i in ids if i not in self._special], skip_special_tokens=True)

    def __reduce__(self):
        return HFTokenizer, (self.path, self.audio, self.video)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


TOKENIZERS = {"byte": ByteTokenizer}


def build_tokenizer(name: str, audio: bool = False, video: bool = False) -> Tokenizer:
    """``data.tokenizer``: a name of ``TOKENIZERS`` or the path of a tokenizer.json or a tiktoken file (with an
    ``<audio>`` token when ``audio``, a ``<video>`` token when ``video``). Raises ValueError in one line."""
    name = str(name)
    if name in TOKENIZERS:
        return TOKENIZERS[name]()
    loader = {"json": HFTokenizer, "tiktoken": TiktokenTokenizer}[file_format(name, tokenizer_file(name))]
    return loader(name, audio, video)


def tokenizer_for(cfg) -> Tokenizer:
    """The run's tokenizer: ``data.tokenizer``, with an ``<audio>`` placeholder when the model has an audio
    tower (model.audio_encoder), a ``<video>`` one when it has a video tower (model.video_encoder)."""
    model = cfg.model
    audio, video = (getattr(model, name, None) is not None for name in ("audio_encoder", "video_encoder"))
    return build_tokenizer(cfg.data.tokenizer, audio, video)
