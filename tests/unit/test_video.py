"""Video through the image encoder: a video member (an animated webp, gif or apng) gives the row up to
``data.video_frames`` frames, spread evenly over it, each an image to the encoder; broken video members are
skipped and counted; the embedded generator draws short videos when asked (``data.synthetic.video_fraction``)."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
from PIL import Image

from disttrain_core.config import SyntheticDataConfig, compose
from disttrain_core.data.images import frame_indices
from disttrain_core.data.loader import MicrobatchLoader
from disttrain_core.data.reader import ShardStream
from disttrain_core.data.samples import BadSample, SampleEncoder
from disttrain_core.data.synthetic import generate_shards, make_sample
from disttrain_core.data.tokenizer import ByteTokenizer

from ..conftest import base_overrides, read_metrics
from .test_data import write_tar

TOK = ByteTokenizer()


def video(frames: int, fmt: str = "WEBP", side: int = 40) -> bytes:
    """``frames`` frames whose red channel counts the frame (frame k: 10 * k)."""
    shots = [Image.new("RGB", (side, side), (10 * k, 100, 50)) for k in range(frames)]
    buffer = io.BytesIO()
    shots[0].save(buffer, format=fmt, save_all=True, append_images=shots[1:], duration=100, lossless=True)
    return buffer.getvalue()


def encoder(video_frames: int = 8, model: str = "mllm_tiny") -> SampleEncoder:
    return SampleEncoder(compose([f"model={model}"]).model, TOK, 0, 10**8, video_frames)


def test_frames_are_spread_evenly_over_the_video():
    assert frame_indices(video(20), 8) == [0, 3, 5, 8, 11, 14, 16, 19]
    assert frame_indices(video(5), 8) == [0, 1, 2, 3, 4]
    assert frame_indices(video(5, "GIF"), 3) == [0, 2, 4]
    assert frame_indices(video(6), 1) == [0]
    still = io.BytesIO()
    Image.new("RGB", (8, 8)).save(still, format="PNG")
    assert frame_indices(still.getvalue(), 8) == [0]


@pytest.mark.parametrize("fmt", ["WEBP", "GIF", "PNG"])  # PNG with save_all: APNG
def test_a_video_member_gives_the_row_its_frames_as_images(fmt):
    enc = encoder(video_frames=4)
    members = {"json": json.dumps({"texts": ["a clip", None], "images": [None, "0.webp"]}).encode()}
    members["0.webp"] = video(10, fmt)
    row = enc.encode("k", members)
    assert row.images.shape == (4, 3, 32, 32)
    red = row.images[:, 0].reshape(4, -1).mean(axis=1)
    assert np.allclose(red, [0, 30, 60, 90], atol=3)  # frames 0, 3, 6, 9 (10 * k in the red channel)
    patches = (32 // 8) ** 2
    assert int((row.tokens == TOK.image_id).sum()) == 4 * patches  # each frame its own patches in the sequence


def test_frames_beyond_the_sequence_are_counted_as_truncated_images():
    enc = encoder(video_frames=16)  # mllm_tiny: 256 positions, 16 patches per frame, 4 generation queries
    members = {"jpg": video(16), "txt": b"a long clip"}
    planned = enc.plan("k", members)
    fit = (256 - 2 - 4 - len(TOK.encode("a long clip"))) // 16
    assert len(planned.images) == fit and planned.truncated_images == 16 - fit


def test_broken_video_members_are_skipped_and_counted(tmp_path):
    good = video(6)
    torn = good[: len(good) * 2 // 3]  # the header reads, the later frames do not
    samples = [
        ("000", {"webp": good, "txt": b"a clip"}),
        ("001", {"webp": torn, "txt": b"a torn clip"}),
        ("002", {"png": video(6, "PNG")[:400], "txt": b"a torn animated png"}),
        ("003", {"webp": good, "txt": b"another clip"}),
    ]
    write_tar(tmp_path / "a.tar", samples)
    stream = ShardStream([str(tmp_path / "a.tar")], 0, 1, seed=0, shuffle=False)
    loader = MicrobatchLoader(stream, encoder(), micro_batch_size=2, microbatches_per_step=1)
    batch = loader.next_step()[0]
    assert [key[-3:] for key in batch.keys] == ["000", "003"]
    assert batch.image_counts.tolist() == [6, 6]
    skipped = loader.state_dict()["skipped"]
    assert skipped.get("bad_video") == 2 and "bad_image" not in skipped, skipped
    with pytest.raises(BadSample) as info:
        encoder().encode("torn", {"webp": torn, "txt": b"x"})
    assert info.value.reason == "bad_video"


def test_the_embedded_generator_draws_videos_only_when_asked():
    import hashlib

    plain = make_sample(SyntheticDataConfig(), 5)  # the default shards are byte-identical to those before video
    assert hashlib.md5(b"".join(plain[k] for k in sorted(plain))).hexdigest() == "9aed12a24769aac16e2e431608f4d0d3"
    counts = []
    for index in range(40):
        members = make_sample(SyntheticDataConfig(video_fraction=1.0, video_frames_max=6, image_side_max=64), index)
        for name, data in members.items():
            if name != "json":
                counts.append(len(frame_indices(data, 100)))
    assert counts and min(counts) >= 2 and max(counts) <= 6 and len(set(counts)) > 2


@pytest.mark.distributed
def test_mllm_tiny_trains_on_video_shards(tmp_path):
    shards = tmp_path / "video"
    generate_shards(
        SyntheticDataConfig(num_shards=2, samples_per_shard=16, image_side_max=64, video_fraction=0.5),
        shards,
        processes=1,
    )
    from disttrain_core.launch.entry import launch

    stream = ShardStream(sorted(str(p) for p in shards.glob("*.tar")), 0, 1, seed=0, shuffle=False)
    rows = MicrobatchLoader(stream, encoder(video_frames=4), micro_batch_size=16, microbatches_per_step=1)
    counts = rows.next_step()[0].image_counts
    assert counts.max() >= 4  # videos reach the encoder as frames
    run_dir = tmp_path / "run"
    launch(
        compose(
            [
                *base_overrides(shards, run_dir),
                "trainer.max_steps=2",
                "optim.warmup_steps=1",
                "data.video_frames=4",
                "trainer.devices=2",
            ]
        )
    )
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2] and all(math.isfinite(m["loss"]) for m in metrics)
