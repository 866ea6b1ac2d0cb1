"""The video tower (model.video_encoder, models/video.py): a video member's frames go to a ViT of their own in groups
of ``temporal_merge`` (the last padded with the last frame), each group averaged into one set of ``<video>``
positions; still images stay with the image encoder; broken videos are skipped and counted; settings that cannot
work are one line each."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from disttrain_core.config import compose
from disttrain_core.data.batch import concat
from disttrain_core.data.loader import MicrobatchLoader, collate
from disttrain_core.data.reader import ShardStream
from disttrain_core.data.samples import BadSample, SampleEncoder
from disttrain_core.data.tokenizer import ByteTokenizer
from disttrain_core.models.video import VideoTower
from disttrain_core.models.vit import VisionTransformer

from .test_data import write_tar
from .test_video import video

TOK = ByteTokenizer()
PATCHES = (32 // 8) ** 2  # vit_video_tiny: 32 px frames, 8 px patches


def encoder(video_frames: int = 8, *overrides: str) -> SampleEncoder:
    return SampleEncoder(compose(["model=any2any_video_tiny", *overrides]).model, TOK, 0, 10**8, video_frames)


def test_a_group_is_the_mean_of_its_frames_through_the_vit():
    cfg = compose(["model=any2any_video_tiny"]).model.video_encoder
    torch.manual_seed(0)
    tower = VideoTower(cfg)
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.1)
    vit = VisionTransformer(cfg)
    vit.load_state_dict(tower.state_dict())
    frames = torch.randint(0, 256, (3, 2, 3, 32, 32), dtype=torch.uint8)
    out = tower(frames)
    per_frame = vit(frames.flatten(0, 1)).view(3, 2, PATCHES, -1)
    assert out.shape == (3, PATCHES, tower.out_dim)
    torch.testing.assert_close(out, per_frame.mean(dim=1), rtol=0, atol=1e-6)
    assert not torch.allclose(out[:, :], per_frame[:, 0])  # both frames count


def test_a_videos_frames_become_groups_of_video_positions_and_a_still_stays_an_image():
    members = {"json": json.dumps({"texts": ["a clip", None, None], "images": [None, "0.webp", "1.png"]}).encode()}
    members["0.webp"] = video(5)  # 5 frames, merged in pairs: 3 groups, the last (frame 4) doubled
    members["1.png"] = video(1, "PNG")
    row = encoder().encode("k", members)
    assert row.video.shape == (3, 2, 3, 32, 32) and row.images.shape == (1, 3, 32, 32)
    red = row.video[:, :, 0].reshape(3, 2, -1).mean(axis=2)
    assert np.allclose(red, [[0, 10], [20, 30], [40, 40]], atol=3)  # frame k: 10 * k in the red channel
    assert int((row.tokens == TOK.video_id).sum()) == 3 * PATCHES
    assert int((row.tokens == TOK.image_id).sum()) == PATCHES
    assert (row.labels[np.append(row.tokens[1:], TOK.pad_id) == TOK.video_id] == -100).all()  # no loss on them
    # the generation target is the last still image, never a frame
    assert row.gen_weight == 1.0 and np.array_equal(row.gen_image, row.images[-1])


def test_groups_beyond_the_sequence_are_counted_with_the_truncated_images():
    enc = encoder(16)  # 256 positions, 4 generation queries: at most 15 groups of 16 fit beside the caption
    planned = enc.plan("k", {"webp": video(40), "txt": b"a long clip"})
    assert len(planned.video) == 8 and planned.truncated_images == 0  # 16 frames: 8 pairs, all fit
    short = encoder(16, "model.seq_len=64")
    planned = short.plan("k", {"webp": video(40), "txt": b"a long clip"})
    fit = (64 - 2 - 4 - len(TOK.encode("a long clip"))) // PATCHES
    assert len(planned.video) == fit and planned.truncated_images == 8 - fit


def test_broken_videos_are_skipped_and_counted_and_batches_carry_the_groups(tmp_path):
    good = video(6)
    torn = good[: len(good) * 2 // 3]  # the header reads, the later frames do not
    samples = [
        ("000", {"webp": good, "txt": b"a clip"}),
        ("001", {"webp": torn, "txt": b"a torn clip"}),
        ("002", {"jpg": video(1, "PNG"), "txt": b"a still"}),
    ]
    write_tar(tmp_path / "a.tar", samples)
    stream = ShardStream([str(tmp_path / "a.tar")], 0, 1, seed=0, shuffle=False)
    loader = MicrobatchLoader(stream, encoder(), micro_batch_size=2, microbatches_per_step=1)
    batch = loader.next_step()[0]
    assert [key[-3:] for key in batch.keys] == ["000", "002"]
    assert batch.video_counts.tolist() == [3, 0] and batch.image_counts.tolist() == [0, 1]
    assert batch.video.shape == (3, 2, 3, 32, 32)
    assert loader.state_dict()["skipped"] == {"bad_video": 1}
    with pytest.raises(BadSample) as info:
        encoder().encode("torn", {"webp": torn, "txt": b"x"})
    assert info.value.reason == "bad_video"
    # a batch's rows keep their own groups when selected and joined again
    tail = batch.select(range(1, 2))
    assert tail.video.shape[0] == 0 and tail.video_counts.tolist() == [0]
    back = concat([batch.select(range(0, 1)), tail])
    assert torch.equal(back.video, batch.video) and torch.equal(back.video_counts, batch.video_counts)


def test_without_a_tower_the_frames_stay_images():
    plain = SampleEncoder(compose(["model=any2any_tiny"]).model, TOK, 0, 10**8, 8)
    row = plain.encode("k", {"webp": video(5), "txt": b"a clip"})
    assert row.images.shape[0] == 5 and row.video.shape[0] == 0
    assert int((row.tokens == TOK.video_id).sum()) == 0
    assert collate([row]).video_counts.tolist() == [0]


def test_the_video_towers_flops_count_each_frame_of_a_group():
    from disttrain_core.models.flops import flops_per_item, module_flops

    model = compose(["model=any2any_video_tiny"]).model
    flops = module_flops(model)
    per_group = flops_per_item(model)[4]
    assert per_group == flops["video_encoder"].train + flops["video_projector"].train > 0
    # two frames through the ViT: twice one frame's (the mean is negligible)
    image = compose(["model=any2any_video_tiny", "model.video_encoder.temporal_merge=1"]).model
    single = module_flops(image)["video_encoder"].train
    assert flops["video_encoder"].train == pytest.approx(2 * single, rel=1e-3)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["~model/encoder"], r"model.video_encoder \(model.name=any2any_video_tiny\) sits beside the image encoder"),
        (["model.video_encoder.temporal_merge=0"], r"model.video_encoder.temporal_merge=0 feature_layer=None"),
        (["model.seq_len=16"], r"model.seq_len=16 cannot hold one video frame group \(16 <video> positions\)"),
        (["parallel=hotspa"], r"parallel.mode=hotspa does not run a video tower"),
        (
            ["parallel=dp", "parallel.units.video_encoder.colocate=false"],
            r"parallel.units.video_encoder.colocate=false gives the video_encoder processes of its own",
        ),
        (
            ["parallel=disagg6_video", "parallel.units.video_encoder.pp=2"],
            r"parallel.units.video_encoder.pp=2 vpp=1: the video_encoder unit runs as one pipeline stage",
        ),
        (
            ["parallel=disagg6_video", "model=any2any_tiny"],
            r"parallel.units.video_encoder.colocate=false but model.video_encoder is null .*model=any2any_video_tiny",
        ),
        (
            ["parallel=disagg6_video", "parallel.units.video_encoder.dp=0"],
            r"parallel.units.video_encoder: dp=0 tp=1 pp=1 vpp=1; each must be at least 1",
        ),
    ],
)
def test_video_settings_that_cannot_work_are_one_line_errors(overrides, message):
    from disttrain_core.validation import ConfigError, validate_config

    base = ["model=any2any_video_tiny", "data=synthetic_any2any"]
    with pytest.raises(ConfigError, match=message) as info:
        validate_config(compose(base + overrides))
    assert "\n" not in str(info.value)


def test_the_planner_weighs_the_video_tower_riding_on_the_llm_or_on_devices_of_its_own():
    """The tower's work per frame group (temporal_merge frames through the ViT) rides on the LLM's first stage, or on
    devices of its own; a plan that places it apart writes a layout the runtime trains (parallel.units)."""
    from disttrain_core.planner import workload_of
    from disttrain_core.planner.auto import layout_container
    from disttrain_core.planner.evaluate import COLOCATED

    from .test_planner_search import AUDIO, every_option

    cfg = compose(["model=any2any_video_tiny"]).model
    work = workload_of(cfg).units["video_encoder"]
    assert work.tokens == 2 * PATCHES and work.items_per_sample == 1.0
    solver = every_option("mllm9b", 24, 32, extra=[*AUDIO, "model/video_encoder=vit_l14_video"])
    plan = solver.solve().evaluation
    model, llm = solver.m, plan.choices["llm"]
    own = solver.audio_options("video_encoder", 8)[0]
    riding, apart = (
        model.llm_end_extras(llm, None, None, 1e12, "none", {"video_encoder": ch})[0] for ch in (COLOCATED, own)
    )
    tower = model.colocated_time("video_encoder", llm.tp, model.micro, "none")  # on the first stage while it rides
    assert tower > 0 and riding - apart == pytest.approx(tower)
    units = layout_container(plan)["units"]
    assert units["video_encoder"]["colocate"] is False and units["video_encoder"]["pp"] == 1


def test_the_planner_counts_the_images_clips_and_groups_the_runtimes_batches_carry(tmp_path):
    """The planner weighs each encoder unit by the items per sample its data really gives (measured_data, through the
    trainer's sample encoder), not by the model's nominal counts: equal to what the runtime's batches carry."""
    from omegaconf import OmegaConf

    from disttrain_core.data.synthetic import generate_shards
    from disttrain_core.planner.workload import measured_data, with_items_per_sample, workload_of

    shape = ["data.synthetic.video_fraction=0.5", "data.synthetic.audio_fraction=0.5", "data.synthetic.num_shards=1"]
    cfg = compose(["model=any2any_video_tiny", f"data.path={tmp_path}", "data.synthetic.samples_per_shard=24", *shape])
    generate_shards(OmegaConf.to_object(cfg.data.synthetic), tmp_path, 1)
    measured, seconds = measured_data(cfg, limit=24)
    stream = ShardStream(sorted(str(p) for p in tmp_path.glob("*.tar")), 0, 1, seed=0, shuffle=False)
    sample_encoder = SampleEncoder(cfg.model, TOK, 0, cfg.data.max_image_pixels, cfg.data.video_frames)
    loader = MicrobatchLoader(stream, sample_encoder, micro_batch_size=24, microbatches_per_step=1)
    batch = loader.next_step()[0]
    carried = {
        "encoder": batch.image_counts.sum().item() / 24,
        "audio_encoder": batch.audio_counts.sum().item() / 24,
        "video_encoder": batch.video_counts.sum().item() / 24,
    }
    assert measured == pytest.approx(carried) and seconds > 0
    assert min(carried.values()) > 0 and carried["video_encoder"] != cfg.model.nominal_video_groups_per_sample
    work = with_items_per_sample(workload_of(cfg.model), measured)
    assert {name: work.units[name].items_per_sample for name in carried} == pytest.approx(carried)


def test_the_profiler_times_every_unit_the_model_has(tmp_path):
    """A profiled cost model times the side units on this machine too (the video and audio towers and the audio
    generator), rather than leaving them to the analytic peak, at 1-8 items each; a frozen tower is timed
    forward only."""
    from disttrain_core.planner import build_layout_model

    cfg = compose(
        ["model=any2any_video_tiny", f"planner.profile_cache={tmp_path}", "planner.profile_repeats=1"]
        + ["parallel=disagg6_video", "planner.tp_options=[1]"]
        + ["model.freeze.video_encoder=true", "model.freeze.video_projector=true"]  # timed forward only
    )
    model = build_layout_model(cfg, devices=1, progress=lambda *_: None)
    assert model.c.source == "profiled"
    assert set(model.c.profiled()) == set(model.c.work.units) >= {"audio_encoder", "video_encoder", "audio_generator"}
    side = [model.c.profile.trials[f"{unit}/1"] for unit in ("audio_encoder", "video_encoder", "audio_generator")]
    assert all([items for items, _ in trials] == [1, 2, 4, 8] and min(t for _, t in trials) > 0 for trials in side)
    assert model.c.compute("video_encoder", 1, 4.0) == pytest.approx(side[1][2][1])  # the profile, not the peak
