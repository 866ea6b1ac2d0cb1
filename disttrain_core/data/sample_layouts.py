"""The sample layouts a webdataset sample's members may have (data/samples.py lists them), read into ordered
segments; and a conversation's turns (data/conversations.py) as token segments with their loss flags."""

from __future__ import annotations

import json

from .bad_sample import BadSample
from .conversations import IMAGE_MARK, messages_of, place_images, render_pieces

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif")  # an animated webp or gif is a video: its frames
AUDIO_EXTENSIONS = ("flac", "wav", "ogg", "mp3")


def _member_kind(name: str) -> str:
    return "audio" if name.rsplit(".", 1)[-1] in AUDIO_EXTENSIONS else "image"


def parse_segments(members: dict[str, bytes]) -> list[tuple[str, object]]:
    """Ordered ``("text", str)`` / ``("image", bytes)`` / ``("audio", bytes)`` segments of a raw sample."""
    meta = None
    if "json" in members:
        try:
            meta = json.loads(members["json"])
        except (ValueError, UnicodeDecodeError) as error:
            raise BadSample("bad_json", str(error)) from error
        if not isinstance(meta, dict):
            raise BadSample("bad_json", "top level is not an object")
    segments: list[tuple[str, object]] = []
    if meta is not None and "texts" in meta and "images" in meta:
        texts, images = meta["texts"], meta["images"]
        if not isinstance(texts, list) or not isinstance(images, list) or len(texts) != len(images):
            raise BadSample("bad_json", "texts and images must be lists of equal length")
        for text, image in zip(texts, images, strict=True):
            if image:
                name = str(image).lower()
                if name not in members:
                    raise BadSample("missing_image", name)
                segments.append((_member_kind(name), members[name]))
            elif text:
                segments.append(("text", str(text)))
    else:
        caption = None
        if meta is not None:
            caption = meta.get("caption") or meta.get("text")
        if caption is None and "txt" in members:
            caption = members["txt"].decode("utf-8", errors="replace")
        image = next((members[ext] for ext in IMAGE_EXTENSIONS if ext in members), None)
        clip = next((members[ext] for ext in AUDIO_EXTENSIONS if ext in members), None)
        if caption:
            segments.append(("text", str(caption)))
        if image is not None:
            segments.append(("image", image))
        if clip is not None:
            segments.append(("audio", clip))
    if not any(kind == "text" and str(value).strip() for kind, value in segments):
        raise BadSample("empty_text")
    return segments


def conversation_of(members: dict[str, bytes]) -> dict | None:
    """The sample's ``json`` when it holds a conversation (``conversations`` or ``messages``), else None."""
    if "json" not in members:
        return None
    try:
        meta = json.loads(members["json"])
    except (ValueError, UnicodeDecodeError) as error:
        raise BadSample("bad_json", str(error)) from error
    return meta if isinstance(meta, dict) and ("conversations" in meta or "messages" in meta) else None


def conversation_segments(
    record: dict, members: dict[str, bytes], tokenizer, template: str, with_images: bool
) -> list[tuple[str, object]]:
    """``("turn", (ids, trained))`` and ``("image", bytes)`` segments of a conversation rendered with the Jinja
    ``template``: the template's text tokenized with its special tokens, the contents as plain text, an eos
    sentinel as ``<eos>``; ``trained`` on the assistant's turns. Without ``with_images``, ``<image>`` marks and
    images are dropped."""
    images = [members[ext] for ext in IMAGE_EXTENSIONS if ext in members][:1]
    messages = messages_of(record)
    if with_images:
        messages = place_images(messages, len(images))
    segments: list[tuple[str, object]] = []
    for kind, text, trained in render_pieces(template, messages):
        if kind == "eos":
            segments.append(("turn", ([tokenizer.eos_id], trained)))
        elif kind == "template":
            segments.append(("turn", (tokenizer.encode_template(text), trained)))
        else:
            parts = text.split(IMAGE_MARK)
            for k, part in enumerate(parts):
                if k and with_images:
                    segments.append(("image", images[0]))
                if part.strip():
                    segments.append(("turn", (tokenizer.encode(part), trained)))
    return [seg for seg in segments if seg[0] != "turn" or seg[1][0]]
