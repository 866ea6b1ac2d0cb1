"""The modalities a run's samples carry against the towers its model has: an audio tower's own shape, where it can
train, and embedded data that would draw a modality no tower reads."""

from __future__ import annotations

from ..config import Config
from .common import _require


def validate_audio(cfg: Config) -> None:
    """model.audio_encoder's shape, and the layouts it trains in: every layout but HotSPa's, with the tower in the
    LLM unit's first stage (parallel/units.py; the planner places it there too)."""
    m, audio = cfg.model, cfg.model.audio_encoder
    validate_audio_generator(cfg)
    validate_audio_units(cfg)
    validate_video(cfg)
    if audio is None:
        return
    _require(
        m.family == "mllm",
        f"model.family={m.family} (model.name={m.name}) takes no audio tower; add model.family=mllm (with an image "
        "encoder) or drop it with ~model/audio_encoder",
    )
    _require(
        audio.dim % audio.n_heads == 0,
        f"model.audio_encoder.dim={audio.dim} is not divisible by model.audio_encoder.n_heads={audio.n_heads}",
    )
    _require(
        audio.n_fft <= round(audio.clip_seconds * audio.sample_rate) and audio.hop_length <= audio.n_fft,
        f"model.audio_encoder: n_fft={audio.n_fft} and hop_length={audio.hop_length} must satisfy hop_length <= "
        f"n_fft <= the clip's {round(audio.clip_seconds * audio.sample_rate)} samples (clip_seconds x sample_rate)",
    )
    from ..data.audio import audio_tokens

    tokens, gen = audio_tokens(audio), m.gen_tokens if m.generator is not None else 0
    _require(
        m.seq_len >= tokens + gen + 3,
        f"model.seq_len={m.seq_len} cannot hold one audio clip ({tokens} <audio> positions) plus {gen} generation "
        "tokens; raise model.seq_len or shorten model.audio_encoder.clip_seconds",
    )
    _require(
        cfg.parallel.mode != "hotspa",
        "parallel.mode=hotspa does not run an audio tower (its strategies cut the LLM into buckets of packed text); "
        "use parallel=dp or a manual layout such as parallel=disagg4_tp2, where the LLM unit's first stage runs it",
    )


def validate_video(cfg: Config) -> None:
    """model.video_encoder's shape, and the layouts it trains in: every layout but HotSPa's, in the LLM unit's
    first stage or a unit of its own (parallel.units.video_encoder; the planner places it either way)."""
    m, video = cfg.model, cfg.model.video_encoder
    if video is None:
        return
    _require(
        m.family == "mllm" and m.encoder is not None,
        f"model.video_encoder (model.name={m.name}) sits beside the image encoder, which this model lacks; add "
        "model/encoder=vit_tiny (or model=any2any_video_tiny), or drop it with ~model/video_encoder",
    )
    _require(
        video.dim % video.n_heads == 0 and video.image_size % video.patch_size == 0,
        f"model.video_encoder: dim={video.dim} must be divisible by n_heads={video.n_heads} and image_size="
        f"{video.image_size} by patch_size={video.patch_size}",
    )
    _require(
        video.temporal_merge >= 1 and video.feature_layer is None,
        f"model.video_encoder.temporal_merge={video.temporal_merge} feature_layer={video.feature_layer}: merge 1 or "
        "more frames per group (2: pairs) and run every block (feature_layer=null)",
    )
    tokens, gen = (video.image_size // video.patch_size) ** 2, m.gen_tokens if m.generator is not None else 0
    _require(
        m.seq_len >= tokens + gen + 3,
        f"model.seq_len={m.seq_len} cannot hold one video frame group ({tokens} <video> positions) plus {gen} "
        "generation tokens; raise model.seq_len or lower model.video_encoder.image_size",
    )
    _require(
        cfg.parallel.mode != "hotspa",
        "parallel.mode=hotspa does not run a video tower (its strategies cut the LLM into buckets of packed text); "
        "use parallel=dp, parallel=auto or a manual layout such as parallel=disagg6_video",
    )


def validate_audio_generator(cfg: Config) -> None:
    """model.audio_generator: trained on the row's last clip (features from the audio tower's front end),
    conditioned on the image generator's <gen> queries, in the LLM unit's last stage."""
    m, gen = cfg.model, cfg.model.audio_generator
    if gen is None:
        return
    _require(
        m.audio_encoder is not None and m.generator is not None,
        "model.audio_generator trains on the clips the audio tower reads, conditioned on the image generator's <gen> "
        "queries: it needs model.audio_encoder and model.generator (model=any2any_tiny has both), or drop it with "
        "~model/audio_generator",
    )
    _require(
        gen.conditioning in ("cross_attention", "film"),
        f"model.audio_generator.conditioning={gen.conditioning!r}: allowed values are cross_attention and film",
    )
    _require(
        1 <= gen.in_channels <= 16,
        f"model.audio_generator.in_channels={gen.in_channels}: the mel latents (4 x 4 space-to-depth, mixed) have 1 to "
        "16 channels; AudioLDM's have 8",
    )
    step = 2 ** (len(gen.block_out_channels) - 1)
    shape = list(gen.latent_shape)
    _require(
        len(shape) == 2 and all(n >= step and n % step == 0 for n in shape),
        f"model.audio_generator.latent_shape={shape}: give [frames, mel bins] of the latent grid, each a multiple of "
        f"{step} (the U-Net halves it {step.bit_length() - 1} times), e.g. [256, 16] as AudioLDM's",
    )


def validate_synthetic_modalities(cfg: Config) -> None:
    """Embedded data told to draw audio clips or videos for a model without the tower that reads them: one line,
    before anything is generated (real shards' clips without a tower are dropped and counted: data/truncated_audio)."""
    m, synthetic = cfg.model, cfg.data.synthetic
    if cfg.data.format != "webdataset":
        return
    if synthetic.audio_fraction > 0:
        _require(
            m.audio_encoder is not None,
            f"data.synthetic.audio_fraction={synthetic.audio_fraction} draws audio clips, but model "
            f"{m.name} has no audio tower to read them; add model/audio_encoder=audio_tiny (or model=any2any_tiny), "
            "or set data.synthetic.audio_fraction=0",
        )
    if synthetic.video_fraction > 0:
        _require(
            m.encoder is not None or m.video_encoder is not None,
            f"data.synthetic.video_fraction={synthetic.video_fraction} draws videos, but model {m.name} has no "
            "image encoder to read their frames; pick a multimodal model (model=mllm_tiny) or set "
            "data.synthetic.video_fraction=0",
        )


def validate_audio_units(cfg: Config) -> None:
    """``parallel.units.audio_encoder`` / ``video_encoder`` / ``audio_generator`` with ``colocate=false``: units of
    their own beside the image encoder / generator unit (parallel/units.py), one pipeline stage each, in manual
    layouts of a model with the module."""
    p, m = cfg.parallel, cfg.model
    example = {"audio_encoder": "any2any_tiny", "video_encoder": "any2any_video_tiny"}
    for name, partner in (("audio_encoder", "encoder"), ("video_encoder", "encoder"), ("audio_generator", "generator")):
        unit = getattr(p.units, name)
        if unit.colocate:
            continue
        where = f"parallel.units.{name}.colocate=false"
        _require(
            p.mode == "manual",
            f"{where} gives the {name} processes of its own in a manual layout; parallel.mode={p.mode} places it in "
            f"the LLM unit: use parallel.mode=manual (e.g. parallel=disagg5_audio) or drop the setting",
        )
        _require(
            getattr(m, name) is not None,
            f"{where} but model.{name} is null (model.name={m.name}); pick a model with one "
            f"(model={example.get(name, 'any2any_tiny')}) or drop the setting",
        )
        _require(
            unit.pp == 1 and unit.vpp == 1,
            f"parallel.units.{name}.pp={unit.pp} vpp={unit.vpp}: the {name} unit runs as one pipeline stage; use "
            "pp=1 (give it dp or tp instead)",
        )
        side = getattr(p.units, partner)
        _require(
            getattr(m, partner) is None or side.colocate or side.pp == 1,
            f"parallel.units.{partner}.pp={side.pp}: the {partner} and {name} units run side by side, one pipeline "
            f"stage each; set parallel.units.{partner}.pp=1 or colocate one of them",
        )
