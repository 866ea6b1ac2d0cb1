"""Where a tokenizer file is, which format it holds, and the special ids both file formats resolve alike.

``data.tokenizer`` names a file, or a directory: its ``tokenizer.json``, else its ``tokenizer.model``. The format
is read from the content, not the name (Llama 2's ``tokenizer.model`` is SentencePiece, Llama 3's is tiktoken):

* a JSON object: a Hugging Face ``tokenizer.json`` (``tokenizer.HFTokenizer``);
* a first line ``<base64 of a token's bytes> <rank>``: a tiktoken BPE file (``tiktoken_bpe.TiktokenTokenizer``).

Anything else is refused in one line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

JSON_FILE = "tokenizer.json"
TIKTOKEN_FILE = "tokenizer.model"
FORMATS = "a Hugging Face tokenizer.json or a tiktoken BPE file (Llama 3's tokenizer.model)"
FIX = f"use data.tokenizer=byte or the path of {FORMATS}"

# Names tried, in order, when tokenizer_config.json does not name the token (or is absent).
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>")
PAD_NAMES = ("<pad>", "<|finetune_right_pad_id|>")
IMAGE_TOKEN = "<image>"
GEN_TOKEN = "<gen>"
AUDIO_TOKEN = "<audio>"
VIDEO_TOKEN = "<video>"

# One line of a tiktoken file: standard base64 (padded), one space, a decimal rank.
TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} [0-9]+\r?")


def tokenizer_file(name: str) -> Path:
    """The file ``data.tokenizer`` names (a directory: its tokenizer.json, else its tokenizer.model); raises
    ValueError when there is none."""
    file = Path(name)
    if file.is_dir():
        file = next((file / n for n in (JSON_FILE, TIKTOKEN_FILE) if (file / n).is_file()), file / JSON_FILE)
    if not file.is_file():
        raise ValueError(f"data.tokenizer={name}: no such file; {FIX}")
    return file


def file_format(name: str, file: Path) -> str:
    """``json`` or ``tiktoken``, from the first bytes of ``file``; anything else raises ValueError in one line."""
    with open(file, "rb") as handle:
        head = handle.read(4096)
    start = head.removeprefix(b"\xef\xbb\xbf").lstrip()
    if start.startswith(b"{"):
        return "json"
    if TIKTOKEN_LINE.fullmatch(head.split(b"\n", 1)[0]):
        return "tiktoken"
    raise ValueError(
        f"data.tokenizer={name}: {file} is neither a Hugging Face tokenizer.json (a JSON object) nor a tiktoken "
        "BPE file (lines of '<base64 token> <rank>'); point data.tokenizer at one of the two (a SentencePiece "
        ".model is not read) or use data.tokenizer=byte"
    )


def placeholder_names(audio: bool, video: bool) -> tuple[str, ...]:
    """The tokens a loader adds when the file lacks them: ``<image>``, ``<gen>``, and ``<audio>``/``<video>`` for a
    model with that tower."""
    return (IMAGE_TOKEN, GEN_TOKEN) + (AUDIO_TOKEN,) * bool(audio) + (VIDEO_TOKEN,) * bool(video)


def _token_name(entry) -> str | None:
    """A ``bos_token``-style entry of tokenizer_config.json: a string, or a dict with ``content``."""
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) and entry else None


def _configured_names(name: str, file: Path) -> dict[str, str | None]:
    """``bos_token``/``eos_token``/``pad_token`` of a tokenizer_config.json beside ``file`` ({} without one)."""
    config_file = file.parent / "tokenizer_config.json"
    if not config_file.is_file():
        return {}
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(
            f"data.tokenizer={name}: {config_file} is not valid JSON ({error}); fix or delete it"
        ) from None
    if not isinstance(config, dict):
        return {}
    return {key: _token_name(config.get(key)) for key in ("bos_token", "eos_token", "pad_token")}


def special_ids(name: str, file: Path, token_to_id: Callable[[str], int | None]) -> tuple[int, int, int]:
    """``(bos, eos, pad)``: the tokens a tokenizer_config.json beside ``file`` names, else the first well-known name
    the tokenizer has (``BOS_NAMES``, ``EOS_NAMES``, ``PAD_NAMES``); pad and bos fall back to eos."""
    names = _configured_names(name, file)

    def find(key: str, candidates: tuple[str, ...]) -> int | None:
        named = names.get(key)
        if named is not None:
            token_id = token_to_id(named)
            if token_id is None:
                raise ValueError(
                    f"data.tokenizer={name}: tokenizer_config.json names {key} {named!r}, which {file.name} does "
                    "not contain; correct the entry or remove it"
                )
            return token_id
        return next((i for i in map(token_to_id, candidates) if i is not None), None)

    eos = find("eos_token", EOS_NAMES)
    if eos is None:
        raise ValueError(
            f"data.tokenizer={name}: no end-of-text token (tried {', '.join(EOS_NAMES)}); name it as eos_token in a "
            f"tokenizer_config.json next to {file.name}"
        )
    bos, pad = find("bos_token", BOS_NAMES), find("pad_token", PAD_NAMES)
    return (eos if bos is None else bos), eos, (eos if pad is None else pad)
