"""Image and video members of a sample: the header checks a row's plan needs (size, frame count) and the pixel
decodes its data worker runs (Pillow). A member with several frames (animated WebP, GIF, APNG) is a video."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from .bad_sample import BadSample

Image.MAX_IMAGE_PIXELS = None  # our own limit (data.max_image_pixels) is checked from the header


def image_size_of(data: bytes, max_pixels: int) -> tuple[int, int]:
    """(width, height) from the image's header alone (no pixels decoded); BadSample if unreadable or too big."""
    try:
        width, height = Image.open(io.BytesIO(data)).size
    except Exception as error:  # PIL raises many types for corrupt data
        raise BadSample("bad_image", f"{type(error).__name__}: {error}") from error
    _check_pixels(width, height, max_pixels)
    return width, height


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise BadSample("huge_image", f"{width}x{height} > data.max_image_pixels={max_pixels}")


def decode_image(data: bytes, sizes: tuple[int, ...], max_pixels: int) -> list[np.ndarray]:
    """Decode once, resize to each square size; uint8 [3, s, s] arrays."""
    image_size_of(data, max_pixels)
    try:
        image = Image.open(io.BytesIO(data))
        image.draft("RGB", (max(sizes), max(sizes)))  # JPEG: decode at reduced scale when possible
        image = image.convert("RGB")
        resized: dict[int, np.ndarray] = {}
        for size in sizes:
            if size not in resized:
                pixels = np.asarray(image.resize((size, size), Image.BILINEAR), dtype=np.uint8)
                resized[size] = np.ascontiguousarray(pixels.transpose(2, 0, 1))
        return [resized[size] for size in sizes]
    except Exception as error:  # PIL raises many types for corrupt data
        raise BadSample("bad_image", f"{type(error).__name__}: {error}") from error


def _animated_header(data: bytes) -> bool:
    """Does an unreadable member say it is animated: a WebP whose VP8X header sets the animation flag, or a PNG
    with an animation-control chunk near its start (APNG)?"""
    webp = data[:4] == b"RIFF" and data[8:16] == b"WEBPVP8X" and len(data) > 20 and bool(data[20] & 0x02)
    return webp or (data[:8] == b"\x89PNG\r\n\x1a\n" and b"acTL" in data[:256])


def frame_indices(data: bytes, max_frames: int, max_pixels: int | None = None) -> list[int]:
    """The frames of an image member the row takes: [0] for a still image; for an animated one (a video: webp,
    gif, apng) ``max_frames`` of them spread evenly from the first to the last (all when it has fewer). With
    ``max_pixels``, also ``image_size_of``'s check, from the same header read."""
    try:
        image = Image.open(io.BytesIO(data))
        count = int(getattr(image, "n_frames", 1))
    except Exception as error:  # PIL raises many types for corrupt data
        reason = "bad_video" if _animated_header(data) else "bad_image"
        raise BadSample(reason, f"{type(error).__name__}: {error}") from error
    if max_pixels is not None:
        _check_pixels(image.width, image.height, max_pixels)
    if count <= 1 or max_frames <= 1:
        return [0]
    if count <= max_frames:
        return list(range(count))
    return [round(i * (count - 1) / (max_frames - 1)) for i in range(max_frames)]


def decode_frame(
    data: bytes, index: int, sizes: tuple[int, ...], max_pixels: int, opened: dict | None = None
) -> list[np.ndarray]:
    """Frame ``index`` of a video member, as ``decode_image`` decodes a still one; BadSample("bad_video").
    ``opened``: the videos of this row already open (by identity), so a row's frames, asked for in order, decode
    each video once from its start (WebP and GIF seek forward incrementally, backward from the first frame)."""
    video = opened.get(id(data)) if opened is not None else None
    if video is None:
        image_size_of(data, max_pixels)
    try:
        if video is None:
            video = Image.open(io.BytesIO(data))
            if opened is not None:
                opened[id(data)] = video
        video.seek(index)
        frame = video.convert("RGB")
        out = []
        for size in sizes:
            pixels = np.asarray(frame.resize((size, size), Image.BILINEAR), dtype=np.uint8)
            out.append(np.ascontiguousarray(pixels.transpose(2, 0, 1)))
        return out
    except Exception as error:  # PIL raises many types for corrupt data
        raise BadSample("bad_video", f"frame {index}: {type(error).__name__}: {error}") from error
