"""Training FLOPs per unit of work, counted exactly on the meta device.

Each module is run once, forward and (when anything makes it necessary)
backward, under ``torch.utils.flop_counter.FlopCounterMode`` on meta tensors:
no memory, no compute. A tower of identical blocks (the LLM, the ViT, the audio
and video towers) is counted by its pieces, each distinct block once: a 70B
LLM in a tenth of a second instead of two. Only matmuls, convolutions
and attention are counted (the usual MFU convention); causal attention is
counted as full (no credit for the masked half), as torchtitan does.

Units: the encoder and its projector per image, the LLM per sequence of
``seq_len`` tokens, the generator and its projector per sample. Freezing is
honoured: a frozen module with nothing trainable upstream costs its forward
only; a frozen module with trainable modules upstream also pays for the
input-gradient half of its backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from ..base.disk_cache import cache_file, read_json, source_digest, write_json
from ..config import ModelConfig
from .audio import AudioEncoder, audio_frames
from .llama import Llama
from .projector import build_projector
from .unet import UNet
from .video import VideoTower
from .vit import VisionTransformer

TOWERS = ("encoder", "encoder_projector", "audio_encoder", "audio_projector", "video_encoder", "video_projector")
CHAIN = (*TOWERS, "llm", "generator_projector", "generator", "audio_generator_projector", "audio_generator")
# What feeds each module, directly or not: the image, audio and video towers sit side by side in front of the LLM.
FEEDS = {
    "encoder": (),
    "encoder_projector": ("encoder",),
    "audio_encoder": (),
    "audio_projector": ("audio_encoder",),
    "video_encoder": (),
    "video_projector": ("video_encoder",),
    "llm": TOWERS,
    "generator_projector": (*TOWERS, "llm"),
    "generator": CHAIN[: CHAIN.index("generator")],
    "audio_generator_projector": CHAIN[: CHAIN.index("generator_projector")],
    "audio_generator": (*CHAIN[: CHAIN.index("generator_projector")], "audio_generator_projector"),
}
UNITS = {
    "encoder": "image",
    "encoder_projector": "image",
    "audio_encoder": "clip",
    "audio_projector": "clip",
    "video_encoder": "video_group",
    "video_projector": "video_group",
    "llm": "sequence",
    "generator_projector": "sample",
    "generator": "sample",
    "audio_generator_projector": "audio_target",  # per row: every row runs it, weight 0 without a clip
    "audio_generator": "audio_target",
}


@dataclass(frozen=True)
class ModuleFlops:
    forward: float  # FLOPs of one forward pass over one unit
    train: float  # forward + backward as training executes it
    unit: str  # image | clip | video_group | sequence | sample | audio_target


def _count(module: torch.nn.Module, inputs: tuple, trainable: bool) -> ModuleFlops:
    """FLOPs of ``module(*inputs)``, plus its backward when needed (an input that carries a gradient, or
    ``trainable``)."""
    module.requires_grad_(trainable)
    forward, train, _ = _counted(module, inputs)
    return ModuleFlops(forward, train, "")


def _counted(fn, inputs: tuple) -> tuple[float, float, torch.Tensor]:
    """(forward FLOPs, forward + backward FLOPs, output) of ``fn(*inputs)``; the backward runs when the output
    carries a gradient (a trainable parameter or an input with one reaches it), as it does in training."""
    counter = FlopCounterMode(display=False)
    with counter:
        out = fn(*inputs)
        forward = counter.get_total_flops()
        if out.requires_grad:
            out.float().sum().backward()
    return float(forward), float(counter.get_total_flops()), out


def _count_stack(module, first, blocks, last, inputs: tuple, trainable: bool, block_args: tuple = ()) -> ModuleFlops:
    """FLOPs of ``last(blocks(first(*inputs)))`` -- what ``_count`` of the whole gives -- counted piece by piece:
    each distinct block (its type, description and parameter shapes, and whether its input carries a gradient)
    once, times its repeats. Counting on meta tensors costs Python dispatch per operator, so a 70B LLM's 80
    identical blocks cost one block's count (tests/unit/test_models.py checks the two ways agree)."""
    module.requires_grad_(trainable)
    forward = train = 0.0
    x = inputs[0]
    if first is not None:
        forward, train, x = _counted(first, inputs)
    seen: dict[tuple, tuple[float, float, torch.Tensor]] = {}
    for block in blocks:
        shapes = tuple((name, tuple(p.shape)) for name, p in block.named_parameters())
        key = (type(block).__name__, repr(block), shapes, tuple(x.shape), x.dtype, x.requires_grad)
        if key not in seen:
            seen[key] = _counted(block, (_leaf(x), *block_args))
        block_forward, block_train, x = seen[key]
        forward, train = forward + block_forward, train + block_train
    last_forward, last_train, _ = _counted(last, (_leaf(x),))
    return ModuleFlops(forward + last_forward, train + last_train, "")


def _leaf(x: torch.Tensor) -> torch.Tensor:
    """A fresh input of ``x``'s shape that carries a gradient where ``x`` does (each piece's backward runs alone)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device, requires_grad=x.requires_grad)


def _count_tower(tower, inputs: tuple, trainable: bool) -> ModuleFlops:
    """An encoder tower with ``embed``, ``blocks`` and ``head`` (the ViT, the audio encoder), counted by its pieces."""
    return _count_stack(tower, tower.embed, tower.blocks.values(), tower.head, inputs, trainable)


def _trainable(cfg: ModelConfig) -> dict[str, bool]:
    present = {
        "encoder": cfg.encoder is not None,
        "encoder_projector": cfg.encoder is not None,
        "audio_encoder": cfg.audio_encoder is not None,
        "audio_projector": cfg.audio_encoder is not None,
        "video_encoder": cfg.video_encoder is not None,
        "video_projector": cfg.video_encoder is not None,
        "llm": True,
        "generator_projector": cfg.generator is not None,
        "generator": cfg.generator is not None,
        "audio_generator_projector": cfg.audio_generator is not None,
        "audio_generator": cfg.audio_generator is not None,
    }
    return {name: present[name] and not getattr(cfg.freeze, name) for name in CHAIN}


def _compute(cfg: ModelConfig) -> dict[str, ModuleFlops]:
    trainable = _trainable(cfg)
    results: dict[str, ModuleFlops] = {}

    def upstream(name: str) -> bool:
        return any(trainable[m] for m in FEEDS[name])

    with torch.device("meta"):
        if cfg.encoder is not None:
            vit = VisionTransformer(cfg.encoder)
            size = cfg.encoder.image_size
            images = torch.empty(1, 3, size, size, dtype=torch.uint8)
            results["encoder"] = _count_tower(vit, (images,), trainable["encoder"])
            proj = build_projector(vit.out_dim, cfg.llm.dim, cfg.encoder_projector)
            feats = torch.empty(1, vit.num_patches, vit.out_dim, requires_grad=upstream("encoder_projector"))
            results["encoder_projector"] = _count(proj, (feats,), trainable["encoder_projector"])

        if cfg.audio_encoder is not None:
            audio = AudioEncoder(cfg.audio_encoder)
            mels = torch.empty(1, cfg.audio_encoder.n_mels, audio_frames(cfg.audio_encoder))
            results["audio_encoder"] = _count_tower(audio, (mels,), trainable["audio_encoder"])
            aproj = build_projector(audio.out_dim, cfg.llm.dim, cfg.audio_projector, "audio_projector")
            feats = torch.empty(1, audio.tokens_per_clip, audio.out_dim, requires_grad=upstream("audio_projector"))
            results["audio_projector"] = _count(aproj, (feats,), trainable["audio_projector"])

        if cfg.video_encoder is not None:
            results.update(_video_tower(cfg, trainable, upstream))
        llm = Llama(cfg.llm, cfg.seq_len)
        hidden = torch.empty(1, cfg.seq_len, cfg.llm.dim, requires_grad=upstream("llm"))

        def head(h: torch.Tensor) -> torch.Tensor:
            return llm.logits(llm.final_norm(h))

        blocks = llm.layers.values()
        results["llm"] = _count_stack(llm, None, blocks, head, (hidden,), trainable["llm"], (llm.rope,))

        if cfg.generator is not None:
            gproj = build_projector(
                cfg.llm.dim, cfg.generator.cross_attention_dim, cfg.generator_projector, "generator_projector"
            )
            queries = torch.empty(1, cfg.gen_tokens, cfg.llm.dim, requires_grad=upstream("generator_projector"))
            results["generator_projector"] = _count(gproj, (queries,), trainable["generator_projector"])
            unet = UNet(cfg.generator)
            side = cfg.gen_image_size // cfg.latent_downsample
            latents = torch.empty(1, cfg.generator.in_channels, side, side)
            timesteps = torch.zeros(1, dtype=torch.long)
            context = torch.empty(
                1, cfg.gen_tokens, cfg.generator.cross_attention_dim, requires_grad=upstream("generator")
            )
            results["generator"] = _count(unet, (latents, timesteps, context), trainable["generator"])
        if cfg.audio_generator is not None:
            results.update(_audio_generator(cfg, trainable, upstream))
    return {name: ModuleFlops(f.forward, f.train, UNITS[name]) for name, f in results.items()}


def _video_tower(cfg: ModelConfig, trainable: dict, upstream) -> dict[str, ModuleFlops]:
    """The video tower and its projector, per frame group: temporal_merge frames through the ViT, one group of
    patch embeddings through the projector."""
    video = cfg.video_encoder
    tower = VideoTower(video)
    groups = torch.empty(1, video.temporal_merge, 3, video.image_size, video.image_size, dtype=torch.uint8)
    proj = build_projector(tower.out_dim, cfg.llm.dim, cfg.video_projector, "video_projector")
    feats = torch.empty(1, tower.num_patches, tower.out_dim, requires_grad=upstream("video_projector"))
    return {
        # the tower runs its frames through the ViT and averages each group (no matmul)
        "video_encoder": _count_tower(tower, (groups.flatten(0, 1),), trainable["video_encoder"]),
        "video_projector": _count(proj, (feats,), trainable["video_projector"]),
    }


def _audio_generator(cfg: ModelConfig, trainable: dict, upstream) -> dict[str, ModuleFlops]:
    """The audio generator and its projector, per generated clip: the U-Net over its latent grid, conditioned on
    the LLM's generation queries."""
    gen = cfg.audio_generator
    proj = build_projector(
        cfg.llm.dim, gen.cross_attention_dim, cfg.audio_generator_projector, "audio_generator_projector"
    )
    queries = torch.empty(1, cfg.gen_tokens, cfg.llm.dim, requires_grad=upstream("audio_generator_projector"))
    out = {"audio_generator_projector": _count(proj, (queries,), trainable["audio_generator_projector"])}
    height, width = gen.latent_shape
    latents = torch.empty(1, gen.in_channels, height, width)
    context = torch.empty(1, cfg.gen_tokens, gen.cross_attention_dim, requires_grad=upstream("audio_generator"))
    inputs = (latents, torch.zeros(1, dtype=torch.long), context)
    out["audio_generator"] = _count(UNet(gen), inputs, trainable["audio_generator"])
    return out


@lru_cache(maxsize=32)
def _cached(cfg_yaml: str) -> dict[str, ModuleFlops]:
    """Counting runs every module forward and backward on meta tensors: about 1 s of a core for mllm_tiny, 7 s for
    mllm72b, paid by every rank that logs MFU at its first log. The counts are kept on disk, keyed by the config
    and by the source of this package (a changed module is counted again)."""
    path = cache_file("module_flops", f"{torch.__version__}|{source_digest(str(Path(__file__).parent))}|{cfg_yaml}")
    cached = read_json(path)
    if cached is not None:
        return {name: ModuleFlops(*value) for name, value in cached.items()}
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.create(cfg_yaml)))
    counts = _compute(cfg)
    write_json(path, {name: [f.forward, f.train, f.unit] for name, f in counts.items()})
    return counts


def module_flops(cfg) -> dict[str, ModuleFlops]:
    """Per-unit FLOPs of every present module (cached per model config)."""
    return _cached(OmegaConf.to_yaml(OmegaConf.structured(cfg) if not OmegaConf.is_config(cfg) else cfg))


def flops_per_item(cfg) -> tuple[float, float, float, float, float]:
    """Training FLOPs per image (encoder side), per sequence (LLM row), per generation target, per audio
    clip (audio tower) and per video frame group (video tower)."""
    per_unit = module_flops(cfg)
    units = ("image", "sequence", "sample", "clip", "video_group")
    return tuple(sum(f.train for f in per_unit.values() if f.unit == unit) for unit in units)  # type: ignore


def batch_flops(
    cfg, sequences: int, images: int, gen_samples: int, clips: int = 0, audio_targets: int = 0, video_groups: int = 0
) -> float:
    """Training FLOPs of a batch with the given amounts of work."""
    per_unit = module_flops(cfg)
    amount = {"image": images, "sequence": sequences, "sample": gen_samples, "clip": clips}
    amount.update(audio_target=audio_targets, video_group=video_groups)
    return sum(f.train * amount[f.unit] for f in per_unit.values())


def flops_per_sample(cfg) -> dict[str, float]:
    """Training FLOPs per sample by module, at ``nominal_images_per_sample`` images per sample."""
    per_unit = module_flops(cfg)
    amount = {"image": cfg.nominal_images_per_sample, "clip": cfg.nominal_clips_per_sample, "sequence": 1.0}
    amount["sample"] = 1.0
    amount["video_group"] = float(cfg.nominal_video_groups_per_sample)
    amount["audio_target"] = 1.0  # every row runs the audio generator (weight 0 without a clip), as the image one
    return {name: f.train * amount[f.unit] for name, f in per_unit.items()}


UNET_TP_MODULES = ("attn1", "attn2", "ff")  # of each spatial transformer: what tensor parallelism splits


def latent_grid(cfg: ModelConfig, unet=None) -> tuple[int, int]:
    """The latent grid a U-Net denoises: its ``latent_shape`` (the audio generator's), else the image
    generator's ``gen_image_size / latent_downsample`` square."""
    unet = cfg.generator if unet is None else unet
    if unet is not None and list(unet.latent_shape):
        height, width = unet.latent_shape
        return int(height), int(width)
    side = cfg.gen_image_size // cfg.latent_downsample
    return side, side


def unet_tensor_parallel(cfg: ModelConfig, unet_cfg=None) -> tuple[float, int, float]:
    """What tensor parallelism splits in the U-Net (parallel/tensor_parallel.py: each spatial transformer's
    attention and GEGLU feed-forward), per sample: (the share of the U-Net's forward FLOPs in them, the
    all-reduces one training step of a sample runs (three row-parallel outputs per transformer forward, three
    input gradients backward), the elements those all-reduces carry). FLOPs counted on meta (forward only:
    FlopCounterMode's module attribution is exact there); their parameters: planner/workload.py's pieces.
    ``unet_cfg``: another U-Net than the image generator (the audio generator)."""
    from .unet import SpatialTransformer

    gen = cfg.generator if unet_cfg is None else unet_cfg
    height, width = latent_grid(cfg, gen)
    with torch.device("meta"):
        unet = UNet(gen)
        latents = torch.empty(1, gen.in_channels, height, width)
        context = torch.empty(1, cfg.gen_tokens, gen.cross_attention_dim)
        shapes: list[tuple[int, ...]] = []
        hooks = [
            m.register_forward_hook(lambda _m, args, _out: shapes.append(tuple(args[0].shape)))
            for m in unet.modules()
            if isinstance(m, SpatialTransformer)
        ]
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            unet(latents, torch.zeros(1, dtype=torch.long), context)
        for hook in hooks:
            hook.remove()
    counts = counter.get_flop_counts()
    split = sum(sum(ops.values()) for name, ops in counts.items() if name.rsplit(".", 1)[-1] in UNET_TP_MODULES)
    elements = sum(6.0 * c * h * w for _, c, h, w in shapes)
    return split / max(1, counter.get_total_flops()), 6 * len(shapes), elements


@lru_cache(maxsize=32)
def _llm_terms(cfg_yaml: str) -> tuple[float, float]:
    """(a, b): the LLM's training FLOPs over one sequence of n tokens are a n + b n^2 (b: attention), solved
    from exact counts at ``seq_len`` and ``seq_len // 2``."""
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.create(cfg_yaml))
    long = int(cfg.seq_len)
    short = max(long // 2, 1)
    if short == long:
        return _cached(cfg_yaml)["llm"].train / long, 0.0
    f_long = _cached(cfg_yaml)["llm"].train
    f_short = module_flops(OmegaConf.merge(cfg, {"seq_len": short}))["llm"].train
    b = (f_long / long - f_short / short) / (long - short)
    return f_long / long - b * long, b


def llm_flop_terms(cfg) -> tuple[float, float]:
    """(a, b) of the LLM's training FLOPs a n + b n^2 over a sequence of n tokens (counted once per config)."""
    return _llm_terms(OmegaConf.to_yaml(OmegaConf.structured(cfg) if not OmegaConf.is_config(cfg) else cfg))


def document_flops(terms: tuple[float, float], lengths) -> float:
    """Training FLOPs of the LLM over documents of ``lengths`` tokens (``terms``: llm_flop_terms), attending
    inside each document only:
    the model's work under packing with document masks (the usual MFU convention: matmuls and attention,
    causal counted as full). A dense masked kernel over a packed row computes more; that is not credited."""
    a, b = terms  # llm_flop_terms(model config)
    return sum(a * n + b * n * n for n in lengths)
