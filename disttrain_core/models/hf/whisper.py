"""Hugging Face Whisper encoders -> the ``audio_encoder`` part (models/audio.py).

Accepted architectures: ``WhisperForConditionalGeneration`` and ``WhisperModel`` (their encoder; the decoder is
ignored), ``WhisperEncoder`` (transformers saves the encoder alone, its tensors without a prefix) and
``WhisperForAudioClassification`` (its encoder; the projector and classifier are ignored). Tensor names are found
after whatever precedes ``conv1.weight`` (``model.encoder.``, ``encoder.`` or nothing), and every tensor under that
prefix must have a place in our tower.

Name map (Hugging Face ``<prefix>`` + name -> ours)::

    conv1.* / conv2.*                             -> conv1.* / conv2.*
    embed_positions.weight                        -> positional_embedding
    layers.<i>.self_attn_layer_norm.*             -> blocks.<i>.norm1.*
    layers.<i>.self_attn.{q,v}_proj.*             -> blocks.<i>.attn.{q,v}.*
    layers.<i>.self_attn.k_proj.weight            -> blocks.<i>.attn.k.weight   (no bias in either)
    layers.<i>.self_attn.out_proj.*               -> blocks.<i>.attn.proj.*
    layers.<i>.final_layer_norm.*                 -> blocks.<i>.norm2.*
    layers.<i>.fc1.* / fc2.*                      -> blocks.<i>.mlp.fc1.* / fc2.*
    layer_norm.*                                  -> norm_post.*

The two towers compute the same function: GELU (erf) after each convolution and in the MLP, pre-norm blocks,
attention scaled by 1/sqrt(head width), a final norm. Whisper's layer norms have eps 1e-5 (not in its config).
A ``preprocessor_config.json`` beside the weights (the Hub's Whisper directories have one) describes the log-mel
front end the weights were trained on; where it exists, our front end (data/audio.py) must be the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ...config import AudioEncoderConfig, ModelConfig
from ...data.audio import audio_tokens
from . import PretrainedError, SafetensorsFiles, register_importer, take_tensors

ARCHITECTURES = ("WhisperForConditionalGeneration", "WhisperModel", "WhisperEncoder", "WhisperForAudioClassification")

# transformers' WhisperConfig defaults: a config.json may leave out a value equal to its default.
ENCODER_DEFAULTS: dict[str, Any] = {
    "num_mel_bins": 80,
    "d_model": 384,
    "encoder_layers": 4,
    "encoder_attention_heads": 6,
    "encoder_ffn_dim": 1536,
    "max_source_positions": 1500,
    "activation_function": "gelu",
}

# Hugging Face key -> our model.audio_encoder field, compared as equal integers.
CONFIG_KEYS = {
    "num_mel_bins": "n_mels",
    "d_model": "dim",
    "encoder_layers": "n_layers",
    "encoder_attention_heads": "n_heads",
    "encoder_ffn_dim": "mlp_dim",
}

# WhisperFeatureExtractor's preprocessor_config.json key -> our model.audio_encoder field
FRONT_END_KEYS = {
    "feature_size": "n_mels",
    "sampling_rate": "sample_rate",
    "n_fft": "n_fft",
    "hop_length": "hop_length",
    "chunk_length": "clip_seconds",
}

NORM_EPS = 1e-5  # nn.LayerNorm's default, which every Whisper layer norm uses

# Hugging Face name inside an encoder layer -> ours inside blocks.<i>
LAYER_NAMES = {
    "self_attn_layer_norm": "norm1",
    "self_attn.q_proj": "attn.q",
    "self_attn.k_proj": "attn.k",
    "self_attn.v_proj": "attn.v",
    "self_attn.out_proj": "attn.proj",
    "final_layer_norm": "norm2",
    "fc1": "mlp.fc1",
    "fc2": "mlp.fc2",
}

ANCHOR = "conv1.weight"


def encoder_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The encoder settings of a Whisper config.json, with transformers' defaults for absent keys."""
    return {key: default if hf_config.get(key) is None else hf_config[key] for key, default in ENCODER_DEFAULTS.items()}


def check_config(hf_config: dict[str, Any], audio: AudioEncoderConfig, source: str = "config.json") -> None:
    """Raise :class:`PretrainedError` (one line: both keys and values, the overrides) unless they match."""
    hf = encoder_config(hf_config)
    if hf["activation_function"] != "gelu":
        raise PretrainedError(
            f"{source}: activation_function={hf['activation_function']} is not supported: the audio tower's MLP "
            "is exact GELU (activation_function=gelu, as in every OpenAI Whisper)"
        )
    problems: list[str] = []
    overrides: list[str] = []
    for hf_key, field in CONFIG_KEYS.items():
        want, have = int(hf[hf_key]), getattr(audio, field)
        if want != have:
            problems.append(f"{hf_key}={want} but model.audio_encoder.{field}={have}")
            overrides.append(f"model.audio_encoder.{field}={want}")
    positions, ours = int(hf["max_source_positions"]), audio_tokens(audio)
    if positions != ours:
        seconds = 2 * positions * audio.hop_length / audio.sample_rate
        problems.append(
            f"max_source_positions={positions} but model.audio_encoder makes {ours} positions (clip_seconds="
            f"{audio.clip_seconds} at sample_rate={audio.sample_rate}, hop_length={audio.hop_length})"
        )
        overrides.append(f"model.audio_encoder.clip_seconds={seconds}")
    if abs(float(audio.norm_eps) - NORM_EPS) > 1e-12:
        problems.append(f"Whisper's layer norms have eps={NORM_EPS} but model.audio_encoder.norm_eps={audio.norm_eps}")
        overrides.append(f"model.audio_encoder.norm_eps={NORM_EPS}")
    if problems:
        raise PretrainedError(
            f"{source} does not match our config: {'; '.join(problems)} (override: {' '.join(overrides)})"
        )


def check_front_end(directory: Path, audio: AudioEncoderConfig) -> None:
    """Raise :class:`PretrainedError` (one line) unless the directory's ``preprocessor_config.json``, where it has
    one, describes our log-mel features: the same bins, rate, window, hop and clip length."""
    path = Path(directory) / "preprocessor_config.json"
    if not path.is_file():
        return
    values = json.loads(path.read_text())
    problems: list[str] = []
    overrides: list[str] = []
    for hf_key, field in FRONT_END_KEYS.items():
        want, have = values.get(hf_key), getattr(audio, field)
        if want is not None and float(want) != float(have):
            problems.append(f"{hf_key}={want} but model.audio_encoder.{field}={have}")
            overrides.append(f"model.audio_encoder.{field}={want}")
    if problems:
        raise PretrainedError(
            f"{path} does not match our log-mel features: {'; '.join(problems)} (override: {' '.join(overrides)})"
        )


def expected_shapes(audio: AudioEncoderConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of AudioEncoder(audio) with its shape, without building it."""
    d, m = audio.dim, audio.mlp_dim
    shapes: dict[str, tuple[int, ...]] = {
        "conv1.weight": (d, audio.n_mels, 3),
        "conv1.bias": (d,),
        "conv2.weight": (d, d, 3),
        "conv2.bias": (d,),
        "positional_embedding": (audio_tokens(audio), d),
        "norm_post.weight": (d,),
        "norm_post.bias": (d,),
    }
    per_block = {"norm1.weight": (d,), "norm2.weight": (d,), "mlp.fc1.weight": (m, d), "mlp.fc2.weight": (d, m)}
    per_block |= {f"attn.{name}.weight": (d, d) for name in ("q", "k", "v", "proj")}
    per_block |= {name[: -len("weight")] + "bias": shape[:1] for name, shape in per_block.items()}
    del per_block["attn.k.bias"]  # Whisper's key projection has none, and neither has ours
    for i in range(audio.n_layers):
        shapes |= {f"blocks.{i}.{name}": shape for name, shape in per_block.items()}
    return shapes


def hf_names(prefix: str, audio: AudioEncoderConfig) -> dict[str, str]:
    """Our parameter name -> the Hugging Face tensor name."""
    names = {f"{conv}.{kind}": f"{prefix}{conv}.{kind}" for conv in ("conv1", "conv2") for kind in ("weight", "bias")}
    names["positional_embedding"] = prefix + "embed_positions.weight"
    names |= {f"norm_post.{kind}": f"{prefix}layer_norm.{kind}" for kind in ("weight", "bias")}
    for i in range(audio.n_layers):
        for theirs, ours in LAYER_NAMES.items():
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{ours}.{kind}"] = f"{prefix}layers.{i}.{theirs}.{kind}"
    return names


def _prefix(directory: Path, names: list[str]) -> str:
    """The encoder's prefix: what precedes ``conv1.weight`` (only the encoder has convolutions)."""
    found = sorted(name[: -len(ANCHOR)] for name in names if name.endswith(ANCHOR))
    found = [p for p in found if p == "" or p.endswith(".")]
    if not found:
        raise PretrainedError(f"{directory}: no tensor named *{ANCHOR}; is this a Whisper encoder checkpoint?")
    return found[0]


def _audio(directory: Path, cfg: ModelConfig) -> AudioEncoderConfig:
    if cfg.audio_encoder is None:
        raise PretrainedError(
            f"{directory}: a Whisper encoder fills model.audio_encoder, but this model has none; "
            "add one with model/audio_encoder=whisper_base (or another conf/model/audio_encoder preset)"
        )
    return cfg.audio_encoder


def load_whisper_encoder(directory: Path, hf_config: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Tensors of the audio tower, by our names relative to it, from a Hugging Face Whisper directory."""
    directory = Path(directory)
    audio = _audio(directory, cfg)
    check_config(hf_config, audio, f"{directory}/config.json")
    check_front_end(directory, audio)
    files = SafetensorsFiles(directory)
    prefix = _prefix(directory, list(files))
    names = hf_names(prefix, audio)
    out = take_tensors(Path(directory), files, names, expected_shapes(audio), "audio_encoder")
    used = {names[ours] for ours in out}
    left = sorted(name for name in files if name.startswith(prefix) and name not in used)
    if left:
        raise PretrainedError(
            f"{directory}: {len(left)} encoder tensor(s) have no place in our audio tower, e.g. {left[0]}; "
            "this importer reads Whisper encoders as transformers builds them"
        )
    return out


def _check(directory: Path, hf_config: dict, cfg: ModelConfig) -> None:
    directory = Path(directory)
    audio = _audio(directory, cfg)
    check_config(hf_config, audio, f"{directory}/config.json")
    check_front_end(directory, audio)


for _architecture in ARCHITECTURES:
    register_importer(_architecture, "audio_encoder", load_whisper_encoder, _check)
