"""Workload presets (planner/presets.py) reach the planner's workload as they say: encoder inputs per sample,
patches per input, the generator and its latent size, frozen modules; and each carries its source."""

import pytest

from disttrain_core.config import compose
from disttrain_core.data.audio import audio_tokens
from disttrain_core.planner.fit import validate_run
from disttrain_core.planner.presets import PRESETS
from disttrain_core.planner.workload import workload_of


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_is_what_the_planner_counts(name):
    preset = PRESETS[name]
    assert len(preset.source) > 40 and preset.generated_per_sample in (0, 1)
    cfg = compose(["model=mllm_tiny", "model.encoder.patch_size=16", "model.seq_len=4096", *preset.overrides()])
    validate_run(cfg)
    work = workload_of(cfg.model).units
    encoder = work["encoder"]
    assert encoder.items_per_sample == pytest.approx(preset.images_per_sample * preset.tiles)
    assert encoder.tokens == (preset.encoder_px // 16) ** 2 + 1  # patches and the class token
    if "encoder" in preset.frozen:  # the ViT frozen, its projector (counted with it) still trained
        assert 0.0 < encoder.trainable_fraction < 0.5
    else:
        assert encoder.trainable_fraction == 1.0
    if preset.generated_per_sample:
        side = preset.generated_px // cfg.model.latent_downsample
        assert work["generator"].tokens == side * side
    else:
        assert "generator" not in work
    if preset.clips_per_sample:  # the audio tower, counted per clip
        assert work["audio_encoder"].items_per_sample == preset.clips_per_sample
        assert work["audio_encoder"].tokens == 1500
    else:
        assert "audio_encoder" not in work
    if preset.video_groups_per_sample:  # the video tower, counted per frame group of temporal_merge frames
        video = work["video_encoder"]
        assert video.items_per_sample == preset.video_groups_per_sample
        assert video.tokens == preset.temporal_merge * 256  # ViT-L/14 at 224 px, no class token
    else:
        assert "video_encoder" not in work


@pytest.mark.parametrize("model", ["mllm9b", "mllm15b", "mllm72b"])
def test_every_preset_fits_the_sequences_of_the_models_it_is_swept_with(model):
    """The mean sample's image tokens (patches of every encoder input) and generation tokens fit seq_len: the
    planner counts LLM work per sequence, so a preset that overflowed it would describe impossible samples."""
    for preset in PRESETS.values():
        cfg = compose([f"model={model}", *preset.overrides()])
        patches = (preset.encoder_px // cfg.model.encoder.patch_size) ** 2
        gen = cfg.model.gen_tokens if preset.generated_per_sample else 0
        audio = cfg.model.audio_encoder
        clips = preset.clips_per_sample * (audio_tokens(audio) if audio is not None else 0)  # <audio> positions
        video = cfg.model.video_encoder
        groups = preset.video_groups_per_sample * ((video.image_size // video.patch_size) ** 2 if video else 0)
        assert preset.images_per_sample * preset.tiles * patches + gen + clips + groups <= cfg.model.seq_len, (
            preset.name
        )


def test_a_preset_says_whether_its_images_per_sample_vary():
    """``skewed`` presets (the straggler model samples their count, planner/stragglers.py) say so in their
    distribution; the others hold a whole number of images in every sample."""
    for preset in PRESETS.values():
        assert preset.skewed == ("skewed" in preset.images_distribution), preset.name
        if not preset.skewed:
            assert preset.images_per_sample == int(preset.images_per_sample), preset.name
    assert {p.name for p in PRESETS.values() if p.skewed} == {"mmc4_interleaved", "obelics_448"}
