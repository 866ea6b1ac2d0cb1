"""Tokenizers behind a small interface.

* ``byte`` (the default, no download): ids 0-255 are UTF-8 bytes, followed by a few special tokens.
* any other ``data.tokenizer`` value is the path of a Hugging Face ``tokenizer.json`` (or of the directory
  holding it), read with the ``tokenizers`` library: :class:`HFTokenizer`.

``encode`` returns the ids of plain text only: the sample encoder (``samples.py``) adds ``<bos>``, ``<eos>``,
image and generation tokens itself, so text can never produce a special id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


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

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


# Names tried, in order, when tokenizer_config.json does not name the token (or is absent).
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>")
PAD_NAMES = ("<pad>", "<|finetune_right_pad_id|>")
IMAGE_TOKEN = "<image>"
GEN_TOKEN = "<gen>"
AUDIO_TOKEN = "<audio>"
VIDEO_TOKEN = "<video>"


def _token_name(entry) -> str | None:
    """A ``bos_token``-style entry of tokenizer_config.json: a string, or a dict with ``content``."""
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) and entry else None


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
        file = Path(self.path)
        if file.is_dir():
            file = file / "tokenizer.json"
        fix = "use data.tokenizer=byte or the path of a Hugging Face tokenizer.json (python tools/train_tokenizer.py)"
        if not file.is_file():
            raise ValueError(f"data.tokenizer={self.path}: no such file; {fix}")
        try:
            backend = Backend.from_file(str(file))
        except Exception as error:  # the Rust side raises a bare Exception for bad JSON or an unknown model
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ValueError(f"data.tokenizer={self.path}: not a readable tokenizer.json ({reason}); {fix}") from None
        names = {}
        config_file = file.parent / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as error:
                raise ValueError(
                    f"data.tokenizer={self.path}: {config_file} is not valid JSON ({error}); fix or delete it"
                ) from None
            if isinstance(config, dict):
                names = {key: _token_name(config.get(key)) for key in ("bos_token", "eos_token", "pad_token")}

        def find(key: str, candidates: tuple[str, ...]) -> int | None:
            named = names.get(key)
            if named is not None:
                token_id = backend.token_to_id(named)
                if token_id is None:
                    raise ValueError(
                        f"data.tokenizer={self.path}: tokenizer_config.json names {key} {named!r}, which "
                        "tokenizer.json does not contain; correct the entry or remove it"
                    )
                return token_id
            return next((i for i in map(backend.token_to_id, candidates) if i is not None), None)

        eos = find("eos_token", EOS_NAMES)
        if eos is None:
            raise ValueError(
                f"data.tokenizer={self.path}: no end-of-text token (tried {', '.join(EOS_NAMES)}); name it as "
                "eos_token in a tokenizer_config.json next to tokenizer.json"
            )
        self.eos_id = eos
        bos = find("bos_token", BOS_NAMES)
        self.bos_id = eos if bos is None else bos
        pad = find("pad_token", PAD_NAMES)
        self.pad_id = eos if pad is None else pad
        self.added: list[str] = []
        wanted = (IMAGE_TOKEN, GEN_TOKEN) + (AUDIO_TOKEN,) * self.audio + (VIDEO_TOKEN,) * self.video
        for name in wanted:
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

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text only, like ByteTokenizer: our special ids are dropped even when the file does not mark them so."""
        return self._backend.decode([i for i in ids if i not in self._special], skip_special_tokens=True)

    def __reduce__(self):
        return HFTokenizer, (self.path, self.audio, self.video)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


TOKENIZERS = {"byte": ByteTokenizer}


def build_tokenizer(name: str, audio: bool = False, video: bool = False) -> Tokenizer:
    """``data.tokenizer``: a name of ``TOKENIZERS`` or the path of a tokenizer.json (with an ``<audio>`` token
    when ``audio``, a ``<video>`` token when ``video``). Raises ValueError."""
    name = str(name)
    if name in TOKENIZERS:
        return TOKENIZERS[name]()
    return HFTokenizer(name, audio, video)


def tokenizer_for(cfg) -> Tokenizer:
    """The run's tokenizer: ``data.tokenizer``, with an ``<audio>`` placeholder when the model has an audio
    tower (model.audio_encoder), a ``<video>`` one when it has a video tower (model.video_encoder)."""
    model = cfg.model
    audio, video = (getattr(model, name, None) is not None for name in ("audio_encoder", "video_encoder"))
    return build_tokenizer(cfg.data.tokenizer, audio, video)
