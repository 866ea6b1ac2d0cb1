"""The audio tower (models/audio.py) and its front end (data/audio.py): decoding, Whisper's log-mel features, the
published sizes, the settings refused in one line, and its place in the planner's model."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile
import torch

from disttrain_core.config import AudioEncoderConfig, compose
from disttrain_core.data.audio import decode_audio, hz_to_mel, log_mel, mel_filters, mel_to_hz
from disttrain_core.data.samples import BadSample
from disttrain_core.data.tokenizer import ByteTokenizer
from disttrain_core.models import build_model, parameter_table
from disttrain_core.models.audio import AudioEncoder, audio_frames, audio_tokens
from disttrain_core.models.common import init_weights


def encoded(wave: np.ndarray, rate: int, fmt: str) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, wave, rate, format=fmt)
    return buffer.getvalue()


def tone(hz: float, seconds: float, rate: int) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * hz * np.arange(round(seconds * rate)) / rate)).astype(np.float32)


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG"])
def test_members_decode_to_mono_at_the_model_rate(fmt):
    stereo = np.stack([tone(440, 0.5, 22050), tone(440, 0.5, 22050)], axis=1)
    wave = decode_audio(encoded(stereo, 22050, fmt), 16000)
    assert wave.dtype == np.float32 and wave.shape == (8000,)  # 0.5 s resampled from 22.05 to 16 kHz
    reference = tone(440, 0.5, 16000)
    middle = slice(1000, 7000)  # away from the resampler's edges; ogg is lossy
    assert np.abs(wave[middle] - reference[middle]).max() < (0.05 if fmt == "OGG" else 2e-3)


@pytest.mark.parametrize("data", [b"", b"RIFF\x00\x00\x00\x00WAVEjunk", b"\xff" * 64])
def test_an_undecodable_member_is_a_bad_sample(data):
    with pytest.raises(BadSample) as info:
        decode_audio(data, 16000)
    assert info.value.reason == "bad_audio"


def test_the_mel_filters_are_slaney_triangles_of_unit_area():
    filters = mel_filters(16000, 400, 128)
    assert filters.shape == (128, 201) and (filters >= 0).all()
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(8000.0), 130))
    assert np.allclose(hz_to_mel(mel_to_hz(np.array([5.0, 15.0, 40.0]))), [5.0, 15.0, 40.0])
    assert hz_to_mel(np.array(1000.0)) == pytest.approx(15.0)
    fine = mel_filters(16000, 4096, 128)  # Whisper's 201 bins are too coarse to integrate its narrow low filters
    bin_hz = 8000.0 / 2048
    wide = (edges[2:] - edges[:-2]) > 8 * bin_hz
    assert wide.sum() > 100
    assert fine[wide].sum(axis=1) * bin_hz == pytest.approx(np.ones(wide.sum()), rel=0.05)
    peaks = fine.argmax(axis=1) * bin_hz  # each triangle peaks at its centre edge
    assert np.abs(peaks[wide] - edges[1:-1][wide]).max() <= bin_hz


def test_whisper_log_mels_of_a_tone_peak_at_its_filter():
    cfg = AudioEncoderConfig()  # Whisper large-v3's front end
    mels = log_mel(tone(1000, 2.0, 16000), cfg)
    assert mels.shape == (128, audio_frames(cfg)) == (128, 3000)
    centers = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(8000.0), 130))[1:-1]
    assert mels[:, :150].mean(axis=1).argmax() == np.abs(centers - 1000).argmin()
    assert mels.max() - mels.min() <= 2.0 + 1e-6  # clipped 8 decades below the peak, scaled by 1/4
    assert np.allclose(mels[:, 250:], mels[:, 250:].min())  # the zero padding after 2 s sits at the floor


def test_the_encoder_maps_mels_to_half_as_many_positions():
    cfg = compose(["model/audio_encoder=audio_tiny"]).model.audio_encoder
    encoder = AudioEncoder(cfg)
    init_weights(encoder, seed=0, std=0.02)
    mels = torch.from_numpy(np.stack([log_mel(tone(300 * (i + 1), 1.0, 8000), cfg) for i in range(3)]))
    out = encoder(mels)
    assert out.shape == (3, audio_tokens(cfg), 64) == (3, 50, 64)
    out.sum().backward()
    assert all(p.grad is not None for p in encoder.parameters())


def test_whisper_large_v3_is_pinned_at_its_published_size():
    """The encoder's count is Hugging Face's WhisperEncoder's for openai/whisper-large-v3; with the decoder of the
    same config, counted here by formula, it is the published 1.55B (1,543,490,560) within 1%."""
    cfg = compose(["model=mllm_tiny", "model/audio_encoder=whisper_large_v3"]).model
    table = parameter_table(build_model(cfg, ByteTokenizer(), device="meta"))
    assert table["audio_encoder"] == 636_968_960
    d, layers, vocab, positions = 1280, 32, 51866, 448
    attention = 4 * d * d + 3 * d  # q, v and out with biases, k without
    block = 2 * attention + 2 * d * 5120 + 5120 + d + 3 * 2 * d  # self- and cross-attention, MLP, 3 norms
    decoder = layers * block + vocab * d + positions * d + 2 * d
    assert table["audio_encoder"] + decoder == 1_543_490_560
    assert abs((table["audio_encoder"] + decoder) / 1.55e9 - 1) < 0.01


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model/audio_encoder=audio_tiny", "model.audio_encoder.dim=66"], "dim=66 is not divisible by .*n_heads=4"),
        (["model=any2any_tiny", "model.seq_len=48"], "cannot hold one audio clip \\(50 <audio> positions\\)"),
        (["model=any2any_tiny", "model.audio_encoder.n_fft=20000"], "n_fft=20000 and hop_length=80 must satisfy"),
        (
            ["model=any2any_tiny", "parallel=hotspa"],
            "hotspa does not run an audio tower.*parallel=dp or a manual layout such as parallel=disagg4_tp2",
        ),
        (["model=llama_tiny", "model/audio_encoder=audio_tiny"], "family=llama .* takes no audio tower"),
        # a sample modality with no tower to read it (embedded data, before anything is generated)
        (["data=synthetic_any2any"], "audio_fraction=0.5 draws audio clips, but model mllm_tiny has no audio tower"),
        (["model=llama_tiny", "data=synthetic_video"], "video_fraction=0.3 draws videos, but model llama_tiny has no"),
        (["model/audio_generator=audioldm_tiny"], "audio_generator trains on the clips the audio tower reads.*needs"),
        (["model=any2any_tiny", "model.audio_generator.latent_shape=[5,8]"], "latent_shape=\\[5, 8\\].* multiple of 2"),
        (["model=any2any_tiny", "model.audio_generator.in_channels=32"], "in_channels=32: the mel latents"),
        # audio units of their own
        (["model=mllm_tiny", "parallel=disagg5_audio"], "audio_encoder.colocate=false but model.audio_encoder is null"),
        (["model=any2any_tiny", "parallel.units.audio_encoder.colocate=false"], "parallel.mode=ddp places it in the"),
        (["model=any2any_tiny", "parallel=disagg5_audio", "parallel.units.audio_encoder.pp=2"], "runs as one pipeline"),
        (
            ["model=any2any_tiny", "parallel=disagg5_audio", "parallel.units.encoder.pp=2"],
            "encoder.pp=2: the encoder and audio_encoder units run side by side",
        ),
        (
            ["model=any2any_tiny", "parallel=disagg5_audio", "parallel.units.audio_encoder.dp=0"],
            "audio_encoder: dp=0 tp=1 pp=1 vpp=1; each must be at least 1 .*colocate=true",
        ),
        (
            ["model=any2any_tiny", "parallel=disagg5_audio", "parallel.units.audio_encoder.tp=3", "trainer.devices=7"],
            "tp=3 does not divide model.audio_encoder.n_heads=4",
        ),
    ],
)
def test_audio_settings_that_cannot_work_are_one_line_errors(overrides, message):
    from disttrain_core.validation import ConfigError, validate_config

    with pytest.raises(ConfigError, match=message) as info:
        validate_config(compose(overrides))
    assert "\n" not in str(info.value)


def test_the_planner_weighs_the_audio_tower_riding_on_the_llm_or_on_devices_of_its_own():
    """The workload counts the tower per clip. Riding in the LLM unit, its first stage carries the tower's time and
    memory (evaluate.py, breakdown.py); on a device of its own beside the image encoder, it takes the 129th device
    the LLM cannot use (mllm9b's plan without audio uses 128) and hides in the encoder's row: the plan does that,
    and is no slower than without audio. (On 64 GPUs the plan now folds every module into one LLM unit at zero2,
    since FSDP2 is charged once per step in a pipeline, and the tower rides there.)"""
    from disttrain_core.planner import COLOCATED, workload_of
    from disttrain_core.planner.api import make_plan

    base = ["cluster=h100_80g", "cluster.num_gpus=129", "model=mllm9b"]
    work = workload_of(compose([*base, "model/audio_encoder=whisper_base"]).model)
    audio = work.units["audio_encoder"]
    assert audio.items_per_sample == 1.0 and audio.tokens == 1500 and audio.params_tp > 0
    plain = make_plan(compose(base)).plan.evaluation
    heard = make_plan(compose([*base, "model/audio_encoder=whisper_base"]))
    found = heard.plan.evaluation
    assert not found.choices["audio_encoder"].colocated and found.gpus == plain.gpus + 1
    assert found.iteration_s == pytest.approx(plain.iteration_s, rel=1e-6)
    choices = found.choices
    riding = heard.model.evaluate(
        choices["llm"], choices["encoder"], choices["generator"], {"audio_encoder": COLOCATED}
    )
    assert riding.iteration_s > found.iteration_s


def test_the_audio_towers_flops_do_not_count_the_image_tower_as_upstream():
    """The image and audio towers sit side by side: a frozen audio encoder's projector takes no input gradient,
    whether the image encoder trains or not (it did when the towers were counted as one chain)."""
    from disttrain_core.models.flops import module_flops

    frozen = ["model/audio_encoder=audio_tiny", "model.freeze.audio_encoder=true"]
    both = module_flops(compose([*frozen, "model.freeze.encoder=true", "model.freeze.encoder_projector=true"]).model)
    audio_only = module_flops(compose(frozen).model)
    trained = module_flops(compose(["model/audio_encoder=audio_tiny"]).model)
    assert audio_only["audio_projector"].train == both["audio_projector"].train
    assert audio_only["audio_projector"].train < trained["audio_projector"].train  # its input gradient, when due
    assert audio_only["audio_encoder"].train == audio_only["audio_encoder"].forward  # frozen, nothing upstream


def test_audioldm_is_pinned_at_its_published_sizes():
    """AudioLDM's U-Net (paper Table 1, U-Net only): S 181M with the FiLM vector added to the timestep embedding;
    L 739M with it concatenated, as the released checkpoints do (S's released one: 185,036,552, the count
    diffusers' UNet2DConditionModel gives for cvssp/audioldm-s-full-v2's config)."""
    counts = {}
    for option, extra in (
        ("audioldm_s", []),
        ("audioldm_s", ["model.audio_generator.film_concat=true"]),
        ("audioldm_l", []),
    ):
        cfg = compose(["model=mllm_tiny", f"model/audio_generator={option}", *extra]).model
        table = parameter_table(build_model(cfg, ByteTokenizer(), device="meta"))
        counts[(option, bool(extra))] = table["audio_generator"]
    assert counts[("audioldm_s", False)] == 180_776_712 and abs(counts[("audioldm_s", False)] / 181e6 - 1) < 0.01
    assert counts[("audioldm_s", True)] == 185_036_552
    assert counts[("audioldm_l", False)] == 739_139_080 and abs(counts[("audioldm_l", False)] / 739e6 - 1) < 0.01


def test_film_conditioning_reaches_every_block_through_the_timestep_embedding():
    """A FiLM U-Net (AudioLDM's conditioning): the pooled conditioning changes the output, its linear gets a
    gradient, and the transformers' second attention attends to the features (no context width in it)."""
    from disttrain_core.models.unet import UNet

    cfg = compose(["model=mllm_tiny", "model/audio_generator=audioldm_tiny"]).model.audio_generator
    unet = UNet(cfg)
    init_weights(unet, seed=0, std=0.02)
    assert unet.down[1].attentions[0].attn2.to_k.in_features == 64  # the level's channels, not a context width
    latents, steps = torch.randn(2, 8, 8, 8), torch.tensor([10, 500])
    context = torch.randn(2, 4, cfg.cross_attention_dim, requires_grad=True)
    out = unet(latents, steps, context)
    other = unet(latents, steps, context.detach() + 1.0)
    assert out.shape == latents.shape and not torch.allclose(out, other)
    out.sum().backward()
    assert unet.film.weight.grad is not None and unet.film.weight.grad.abs().sum() > 0
    assert context.grad is not None and context.grad.abs().sum() > 0
