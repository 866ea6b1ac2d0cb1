"""Audio members of a sample: decoding (wav, flac, ogg through libsndfile's ``soundfile``) and Whisper's log-mel
features, computed in the data workers so the trainers receive [n_mels, frames] float arrays.

The features follow Whisper's front end: mono, resampled to ``sample_rate`` (scipy's polyphase filter), cut or
zero-padded to ``clip_seconds``, a centred STFT with a periodic Hann window of ``n_fft`` samples every
``hop_length`` (its last frame dropped), the power spectrum through a Slaney-style mel filterbank (as librosa's
``mel(htk=False, norm="slaney")``), ``log10`` floored at 1e-10, clipped to 8 below its maximum, then
``(x + 4) / 4``. An undecodable member raises ``BadSample("bad_audio")``, what the sample readers skip and count:
``check_audio`` from the header when a sample is planned, ``decode_audio`` when its features are computed.
"""

from __future__ import annotations

import functools
import io
import math

import numpy as np
import torch

from ..config import AudioEncoderConfig
from .bad_sample import BadSample


def audio_frames(cfg: AudioEncoderConfig) -> int:
    """Log-mel frames per clip (Whisper drops the centred STFT's last frame): 3,000 for 30 s at 100 per second."""
    return round(cfg.clip_seconds * cfg.sample_rate) // cfg.hop_length


def audio_tokens(cfg: AudioEncoderConfig) -> int:
    """The audio encoder's output positions per clip, each one ``<audio>`` placeholder of the row: the frames
    after its stride-2 convolution (1,500 for Whisper)."""
    return (audio_frames(cfg) + 1) // 2


def check_audio(data: bytes) -> None:
    """BadSample("bad_audio") unless the member's header reads as audio with at least one sample (nothing
    decoded: what planning a row needs)."""
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception as error:  # libsndfile raises its own error types for corrupt or unknown data
        raise BadSample("bad_audio", f"{type(error).__name__}: {error}") from error
    if info.frames <= 0 or info.samplerate <= 0:
        raise BadSample("bad_audio", f"{info.frames} frames at {info.samplerate} Hz")


def decode_audio(data: bytes, sample_rate: int) -> np.ndarray:
    """A mono float32 waveform at ``sample_rate`` Hz from an encoded file; BadSample if it cannot be read."""
    import soundfile

    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as error:  # libsndfile raises its own error types for corrupt or unknown data
        raise BadSample("bad_audio", f"{type(error).__name__}: {error}") from error
    if samples.size == 0:
        raise BadSample("bad_audio", "no samples")
    wave = samples.mean(axis=1)
    if rate != sample_rate:
        from scipy.signal import resample_poly

        common = math.gcd(int(rate), int(sample_rate))
        wave = resample_poly(wave, sample_rate // common, int(rate) // common).astype(np.float32)
    if not np.isfinite(wave).all():
        raise BadSample("bad_audio", "non-finite samples")
    return np.ascontiguousarray(wave, dtype=np.float32)


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz * 3.0 / 200.0
    log_step = math.log(6.4) / 27.0
    return np.where(hz >= 1000.0, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / log_step, linear)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    log_step = math.log(6.4) / 27.0
    return np.where(mel >= 15.0, 1000.0 * np.exp(log_step * (mel - 15.0)), mel * 200.0 / 3.0)


@functools.cache
def mel_filters(sample_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1] triangular filters between mel-spaced edges from 0 Hz to Nyquist, each scaled to
    unit area over its band (Slaney normalization)."""
    freqs = np.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1)
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2.0), n_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - freqs[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights.astype(np.float32)


def log_mel(wave: np.ndarray, cfg: AudioEncoderConfig) -> np.ndarray:
    """Whisper's log-mel features [n_mels, frames] of one clip (cut or zero-padded to ``clip_seconds``)."""
    length = round(cfg.clip_seconds * cfg.sample_rate)
    clip = np.zeros(length, dtype=np.float32)
    clip[: min(length, wave.shape[0])] = wave[:length]
    audio = torch.from_numpy(clip)
    window = torch.hann_window(cfg.n_fft)
    spectrum = torch.stft(audio, cfg.n_fft, cfg.hop_length, window=window, center=True, return_complex=True)
    power = spectrum[:, :-1].abs() ** 2
    mel = torch.from_numpy(mel_filters(cfg.sample_rate, cfg.n_fft, cfg.n_mels)) @ power
    logs = torch.clamp(mel, min=1e-10).log10()
    logs = torch.maximum(logs, logs.max() - 8.0)
    return ((logs + 4.0) / 4.0).numpy().astype(np.float32)
