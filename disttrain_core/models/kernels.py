"""Which operators a model's training step runs, found on the meta device, and which of them have no
deterministic CUDA kernel.

With ``torch.use_deterministic_algorithms(True)`` such an operator raises at its first call, minutes
into a GPU job. ``nondeterministic_cuda_ops`` runs one forward and backward of the configured model on
meta tensors (no memory, no compute) under a dispatch mode that records every operator, and matches
them against torch's list of CUDA operators that throw in deterministic mode (the
``torch.use_deterministic_algorithms`` documentation of torch 2.13), so validation can say so before
launch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch
from omegaconf import OmegaConf

from ..base.torch_compat import TorchDispatchMode
from ..config import ModelConfig

aten = torch.ops.aten


def _always(args, kwargs) -> bool:
    return True


def _floating_input(args, kwargs) -> bool:
    return args[0].is_floating_point() or args[0].is_complex()


def _reduces(args, kwargs) -> bool:  # nll_loss2d(self, target, weight, reduction, ignore_index)
    reduction = args[3] if len(args) > 3 else kwargs.get("reduction", 1)
    return reduction != 0


def _overwrites(args, kwargs) -> bool:  # put_(self, index, source, accumulate)
    return not (args[3] if len(args) > 3 else kwargs.get("accumulate", False))


def _weighted(args, kwargs) -> bool:  # bincount(self, weights, minlength)
    return (args[1] if len(args) > 1 else kwargs.get("weights")) is not None


def _product(args, kwargs) -> bool:  # scatter_reduce(self, dim, index, src, reduce, include_self)
    return (args[4] if len(args) > 4 else kwargs.get("reduce")) == "prod"


# Operators that raise on CUDA under use_deterministic_algorithms(True), with the condition under which
# they do. Backward kernels appear under their own names: they run in the backward pass.
NONDETERMINISTIC_CUDA: dict[object, Callable] = {
    aten.avg_pool3d_backward: _always,
    aten._adaptive_avg_pool2d_backward: _always,
    aten._adaptive_avg_pool3d_backward: _always,
    aten.adaptive_max_pool2d_backward: _always,
    aten.fractional_max_pool2d_backward: _always,
    aten.fractional_max_pool3d_backward: _always,
    aten.max_unpool2d: _always,
    aten.max_unpool3d: _always,
    aten.upsample_linear1d_backward: _always,
    aten.upsample_bilinear2d_backward: _always,
    aten.upsample_bicubic2d_backward: _always,
    aten.upsample_trilinear3d_backward: _always,
    aten.reflection_pad1d_backward: _always,
    aten.reflection_pad2d_backward: _always,
    aten.reflection_pad3d_backward: _always,
    aten.nll_loss2d_forward: _reduces,
    aten._ctc_loss_backward: _always,
    aten.put_: _overwrites,
    aten.histc: _always,
    aten.bincount: _weighted,
    aten.grid_sampler_2d_backward: _always,
    aten.grid_sampler_3d_backward: _always,
    aten.cumsum: _floating_input,
    aten.scatter_reduce: _product,
}


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        condition = NONDETERMINISTIC_CUDA.get(func.overloadpacket)
        if condition is not None and condition(args, kwargs):
            self.found.add(f"aten.{func.overloadpacket.__name__}")
        return func(*args, **kwargs)


def _meta_batch(cfg: ModelConfig):
    from ..data.batch import Batch

    seq = cfg.seq_len
    images, gen = cfg.encoder, cfg.generator
    side = images.image_size if images is not None else 1
    gen_side = cfg.gen_image_size
    latent = gen_side // cfg.latent_downsample
    channels = gen.in_channels if gen is not None else 1
    return Batch(
        tokens=torch.zeros(1, seq, dtype=torch.long),
        labels=torch.zeros(1, seq, dtype=torch.long),
        images=torch.zeros(1 if images is not None else 0, 3, side, side, dtype=torch.uint8),
        image_counts=torch.ones(1, dtype=torch.long),
        gen_images=torch.zeros(1, 3, gen_side, gen_side, dtype=torch.uint8),
        gen_weight=torch.ones(1),
        gen_noise=torch.zeros(1, channels, latent, latent),
        gen_timesteps=torch.zeros(1, dtype=torch.long),
        **_meta_audio(cfg),
        **_meta_video(cfg),
    )


def _meta_video(cfg: ModelConfig) -> dict:
    """The video fields of the one-row meta batch: one frame group for the tower."""
    video = cfg.video_encoder
    if video is None:
        return {}
    side, merge = video.image_size, video.temporal_merge
    groups = torch.zeros(1, merge, 3, side, side, dtype=torch.uint8)
    return {"video": groups, "video_counts": torch.ones(1, dtype=torch.long)}


def _meta_audio(cfg: ModelConfig) -> dict:
    """The audio fields of the one-row meta batch: a clip for the tower, a target for the generator."""
    from ..data.audio import audio_frames

    audio, gen = cfg.audio_encoder, cfg.audio_generator
    if audio is None:
        return {}
    mels = torch.zeros(1, audio.n_mels, audio_frames(audio))
    out = {"audio": mels, "audio_counts": torch.ones(1, dtype=torch.long)}
    if gen is not None:
        out.update(gen_audio=mels[0:1], audio_gen_weight=torch.ones(1), audio_gen_timesteps=torch.zeros(1).long())
        out["audio_gen_noise"] = torch.zeros(1, gen.in_channels, *gen.latent_shape)
    return out


def _training_step_ops(cfg: ModelConfig) -> list[str]:
    from ..data.tokenizer import ByteTokenizer
    from .mllm import MultimodalLLM

    tokenizer = ByteTokenizer()
    with torch.device("meta"):
        model = MultimodalLLM(cfg, tokenizer.image_id, tokenizer.gen_id, tokenizer.audio_id, tokenizer.video_id)
        batch = _meta_batch(cfg)
    recorder = _Recorder()
    with recorder:
        out = model(batch)
        loss = out["lm_loss_sum"] + out.get("gen_loss_sum", 0.0)
        if loss.requires_grad:
            loss.backward()
    return sorted(recorder.found)


@lru_cache(maxsize=16)
def _cached(cfg_yaml: str) -> tuple[str, ...]:
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.create(cfg_yaml)))
    return tuple(_training_step_ops(cfg))


def nondeterministic_cuda_ops(cfg) -> list[str]:
    """Operators of the model's training step that raise on CUDA in deterministic mode (empty: none)."""
    return list(_cached(OmegaConf.to_yaml(cfg if OmegaConf.is_config(cfg) else OmegaConf.structured(cfg))))
