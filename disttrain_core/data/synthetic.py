"""Embedded LAION-like interleaved image-text shards with realistic skew.

Each sample is an interleaved document in the MMC4/OBELICS layout::

    key.json : {"texts": ["caption 0", null, "caption 1", null],
                "images": [null, "0.jpg", null, "1.png"]}
    key.0.jpg, key.1.png : the images

Distributions (parameters in ``SyntheticDataConfig``; docs/DATA.md):

* images per sample: 0 with probability ``text_only_fraction``, otherwise a
  geometric law on 1, 2, ... (success probability ``images_geometric_p``)
  truncated at ``max_images`` -- most samples carry one or two images, a few
  carry many, which is the skew that makes encoder work uneven;
* words per text segment: log-normal (``caption_words_log_mean/sigma``), a
  long right tail like LAION captions;
* image size: shorter side log-normal (``image_side_log_mean/sigma``, capped
  at ``image_side_max``), aspect ratio log-normal (``aspect_log_sigma``);
  85% JPEG, 10% PNG, 5% WebP;
* videos (``video_fraction`` of the images, 0 by default): animated WebP of 2..``video_frames_max`` frames;
* audio (``audio_fraction`` of the samples, 0 by default): one FLAC clip at the end, 0.5-2 s of a tone whose
  pitch and glide a caption before the last image names ("sound of a high tone rising").

Captions describe what is drawn ("photo of a red circle on blue, ..."),
so the language model and the generator both have something to learn.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import shutil
import tempfile
from multiprocessing import Pool
from pathlib import Path

from PIL import Image, ImageChops, ImageDraw

from ..config import SyntheticDataConfig

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 220, 40),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "pink": (240, 130, 180),
    "brown": (130, 80, 40),
    "gray": (128, 128, 128),
    "cyan": (40, 200, 210),
}
SHAPES = ("circle", "square", "triangle", "ellipse", "cross", "ring", "stripe", "diamond")
STYLES = ("photo", "drawing", "painting", "render", "sketch", "poster", "icon", "picture")
FILLER = (
    "with",
    "soft",
    "light",
    "in",
    "the",
    "morning",
    "bright",
    "small",
    "large",
    "detailed",
    "simple",
    "high",
    "quality",
    "stock",
    "image",
    "of",
    "a",
    "centered",
    "minimal",
    "vintage",
    "modern",
    "style",
    "background",
    "texture",
    "art",
    "beautiful",
    "clean",
    "flat",
    "vector",
    "shadow",
    "and",
)
FORMATS = (("jpg", 0.85), ("png", 0.10), ("webp", 0.05))


def _geometric(rng: random.Random, p: float, maximum: int) -> int:
    count = 1
    while count < maximum and rng.random() > p:
        count += 1
    return count


def _caption(rng: random.Random, fg: str, shape: str, bg: str, cfg: SyntheticDataConfig) -> str:
    words = max(4, int(round(math.exp(rng.gauss(cfg.caption_words_log_mean, cfg.caption_words_log_sigma)))))
    core = f"{rng.choice(STYLES)} of a {fg} {shape} on {bg}"
    filler = " ".join(rng.choice(FILLER) for _ in range(max(0, words - 7)))
    return f"{core}, {filler}" if filler else core


def _draw(rng: random.Random, fg: str, shape: str, bg: str, cfg: SyntheticDataConfig) -> Image.Image:
    side = math.exp(rng.gauss(cfg.image_side_log_mean, cfg.image_side_log_sigma))
    aspect = math.exp(rng.gauss(0.0, cfg.aspect_log_sigma))
    width = int(min(cfg.image_side_max, max(16, side * max(1.0, aspect))))
    height = int(min(cfg.image_side_max, max(16, side * max(1.0, 1.0 / aspect))))
    image = Image.new("RGB", (width, height), COLORS[bg])
    draw = ImageDraw.Draw(image)
    size = rng.uniform(0.35, 0.7) * min(width, height)
    cx, cy = width * rng.uniform(0.35, 0.65), height * rng.uniform(0.35, 0.65)
    box = (cx - size / 2, cy - size / 2, cx + size / 2, cy + size / 2)
    color = COLORS[fg]
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    elif shape == "triangle":
        draw.polygon([(cx, box[1]), (box[0], box[3]), (box[2], box[3])], fill=color)
    elif shape == "ellipse":
        draw.ellipse((box[0], cy - size / 4, box[2], cy + size / 4), fill=color)
    elif shape == "cross":
        draw.rectangle((box[0], cy - size / 8, box[2], cy + size / 8), fill=color)
        draw.rectangle((cx - size / 8, box[1], cx + size / 8, box[3]), fill=color)
    elif shape == "ring":
        draw.ellipse(box, outline=color, width=max(2, int(size / 8)))
    elif shape == "stripe":
        draw.rectangle((0, cy - size / 6, width, cy + size / 6), fill=color)
    else:  # diamond
        draw.polygon([(cx, box[1]), (box[2], cy), (cx, box[3]), (box[0], cy)], fill=color)
    return image


def _encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    if fmt == "jpg":
        image.save(buffer, format="JPEG", quality=85)
    elif fmt == "png":
        image.save(buffer, format="PNG")
    else:
        image.save(buffer, format="WEBP", quality=80)
    return buffer.getvalue()


def _encode_video(image: Image.Image, frames: int) -> bytes:
    """An animated WebP of ``frames`` frames: the scene sliding diagonally, wrapping around, across its size (both
    ways, so a stripe moves too: WebP merges identical frames)."""
    width, height = image.size
    shots = [ImageChops.offset(image, round(k * width / frames), round(k * height / frames)) for k in range(frames)]
    buffer = io.BytesIO()
    shots[0].save(buffer, format="WEBP", save_all=True, append_images=shots[1:], duration=100, quality=80)
    return buffer.getvalue()


def make_sample(cfg: SyntheticDataConfig, index: int) -> dict[str, bytes]:
    """The tar members of sample ``index`` (deterministic in ``cfg.seed`` and ``index``)."""
    rng = random.Random(cfg.seed * 1_000_003 + index)
    if rng.random() < cfg.text_only_fraction:
        n_images = 0
    else:
        n_images = _geometric(rng, cfg.images_geometric_p, cfg.max_images)
    texts: list[str | None] = []
    images: list[str | None] = []
    members: dict[str, bytes] = {}
    for i in range(max(1, n_images)):
        fg, bg = rng.sample(sorted(COLORS), 2)
        shape = rng.choice(SHAPES)
        texts.append(_caption(rng, fg, shape, bg, cfg))
        images.append(None)
        if i < n_images:
            fmt = rng.choices([f for f, _ in FORMATS], weights=[w for _, w in FORMATS])[0]
            if cfg.video_fraction > 0 and rng.random() < cfg.video_fraction:  # no draw without video: same shards
                frames = rng.randint(2, cfg.video_frames_max)
                name = f"{i}.webp"
                members[name] = _encode_video(_draw(rng, fg, shape, bg, cfg), frames)
            else:
                name = f"{i}.{fmt}"
                members[name] = _encode(_draw(rng, fg, shape, bg, cfg), fmt)
            texts.append(None)
            images.append(name)
    if cfg.audio_fraction > 0 and rng.random() < cfg.audio_fraction:  # no draw without audio: same shards
        caption, members["a.flac"] = _clip(rng)
        # its caption before the last image and the clip after it: the <gen> queries, placed before the last
        # image (data/samples.py), see both targets' captions and neither target
        at = len(texts) - (1 if images[-1] is not None else 0)
        texts[at:at] = [caption]
        images[at:at] = [None]
        texts.append(None)
        images.append("a.flac")
    members["json"] = json.dumps({"texts": texts, "images": images}).encode()
    return members


PITCHES = {"low": 220.0, "middle": 440.0, "high": 880.0}
GLIDES = {"rising": 1.5, "falling": 1 / 1.5, "steady": 1.0}


def _clip(rng: random.Random) -> tuple[str, bytes]:
    """A caption and a FLAC clip (16 kHz mono, 0.5-2 s) of the tone it names: a pitch that glides
    geometrically by the named factor over the clip, with a little noise."""
    import numpy as np
    import soundfile

    pitch, glide = rng.choice(sorted(PITCHES)), rng.choice(sorted(GLIDES))
    rate, seconds = 16_000, rng.uniform(0.5, 2.0)
    t = np.arange(int(rate * seconds)) / rate
    ratio = GLIDES[glide]
    frequency = PITCHES[pitch] * ratio ** (t / seconds)
    phase = 2 * np.pi * np.cumsum(frequency) / rate
    noise = np.random.default_rng(rng.getrandbits(32)).normal(0.0, 0.01, t.shape)
    wave = (0.5 * np.sin(phase) + noise).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, wave, rate, format="FLAC")
    return f"sound of a {pitch} tone {glide}", buffer.getvalue()


def _write_shard(args: tuple[SyntheticDataConfig, str, int]) -> str:
    import webdataset as wds

    cfg, path, shard = args
    with wds.TarWriter(path) as writer:
        for j in range(cfg.samples_per_shard):
            index = shard * cfg.samples_per_shard + j
            writer.write({"__key__": f"{index:09d}", **make_sample(cfg, index)})
    return path


def generate_shards(
    cfg: SyntheticDataConfig, out_dir: str | os.PathLike, processes: int = 2, held_out: bool = False
) -> list[str]:
    """Write ``cfg.num_shards`` shards into ``out_dir`` atomically (temp dir, then rename). ``held_out``: the
    held-out split instead, ``cfg.val_shards`` shards of the samples after the training shards' (data.val)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    numbers = range(cfg.num_shards, cfg.num_shards + cfg.val_shards) if held_out else range(cfg.num_shards)
    jobs = [(cfg, str(tmp / f"shard-{s:06d}.tar"), s) for s in numbers]
    try:
        if processes > 1 and len(jobs) > 1:
            with Pool(min(processes, len(jobs))) as pool:
                pool.map(_write_shard, jobs)
        else:
            for job in jobs:
                _write_shard(job)
        try:
            tmp.rename(out)
        except OSError:
            if not out.is_dir():  # another process won the race and the result is there
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return sorted(str(p) for p in out.glob("*.tar"))
