"""What each parallelism unit has to compute and store, read off the model config.

Everything comes from the real modules built on the meta device (parameter counts)
and from the FLOP counter (models/flops.py), so the planner and the trainer agree
on the model; nothing is estimated from a formula that could drift from the code.

Work is counted per *item*: the encoder per image, the LLM per sequence, the
generator per sample. ``items_per_sample`` turns samples into items (images per
sample for the encoder, from ``model.nominal_images_per_sample``).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

from omegaconf import OmegaConf

from ..base.disk_cache import cache_file, read_json, write_json
from ..config import ModelConfig, image_tokens
from .unit_work import UnitWork, Workload


def _moe_work(cfg: ModelConfig, llm, count) -> dict:
    """The MoE fields of the LLM's UnitWork: routed-expert and router parameter counts (from the built
    modules; the shared experts count with the dense block parameters: TP splits them the same way) and the
    routers' training FLOPs per sequence, the part of a MoE layer TP does not split. The FLOP counter credits a
    MoE layer on meta (models/moe.py ``_balanced_estimate``) with: every token runs the router (dim x E), its
    top_k experts and the shared experts (SwiGLU: three dim x hidden matmuls, split by TP); backward is twice
    the forward."""
    moe = getattr(cfg.llm, "moe", None)
    if moe is None:
        return {}
    layers = list(llm.layers.values())
    experts = sum(count(layer.feed_forward.experts) for layer in layers)
    rep = sum(count(layer.feed_forward.router) for layer in layers)
    hidden = moe.expert_ffn_dim or cfg.llm.ffn_dim
    dim = cfg.llm.dim
    router_per_token = 2 * dim * moe.num_experts
    return {
        "params_expert": experts,
        "params_moe_rep": rep,
        "flops_moe": 3.0 * router_per_token * cfg.seq_len * len(layers),
        "num_experts": moe.num_experts,
        "top_k": moe.top_k,
        "expert_dim": hidden,
        "shared_experts": moe.shared_experts,
    }


def _unet_pieces(unet, proj) -> tuple:
    """(replicated, TP-split) parameters of the U-Net's pipeline pieces: first-stage extras, segments, output."""
    from ..models.flops import UNET_TP_MODULES
    from ..models.unet import SpatialTransformer

    def piece(*modules) -> tuple[int, int]:
        split = sum(
            _count(getattr(m, name))
            for module in modules
            for m in module.modules()
            if isinstance(m, SpatialTransformer)
            for name in UNET_TP_MODULES
        )
        return sum(_count(m) for m in modules) - split, split

    first = piece(proj, unet.conv_in, unet.time_linear1, unet.time_linear2)
    segments = [piece(level) for level in unet.down] + [piece(unet.mid_res1, unet.mid_attn, unet.mid_res2)]
    segments += [piece(level) for level in unet.up]
    return (first, *segments, piece(unet.norm_out, unet.conv_out))


def _count(module) -> int:
    """Parameters of ``module`` (0 for None)."""
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def _trainable(*pairs) -> float:
    """Share of the parameters of ``(module, frozen)`` pairs that are not frozen."""
    total = sum(_count(m) for m, _ in pairs)
    kept = sum(_count(m) for m, frozen in pairs if not frozen)
    return kept / total if total else 0.0


def _build(cfg: ModelConfig) -> Workload:

    from ..data.tokenizer import ByteTokenizer
    from ..models import build_model
    from ..models.flops import module_flops

    model = build_model(cfg, ByteTokenizer(), device="meta")
    flops = module_flops(cfg)

    units: dict[str, UnitWork] = {}
    units["llm"] = _llm_work(cfg, model, flops)
    if cfg.encoder is not None:
        units["encoder"] = _encoder_work(cfg, model, flops)
    if cfg.generator is not None:
        units["generator"] = _generator_work(cfg, model, flops)
    if cfg.audio_encoder is not None:
        units["audio_encoder"] = _audio_work(cfg, model, flops)
    if cfg.video_encoder is not None:
        units["video_encoder"] = _video_work(cfg, model, flops)
    if cfg.audio_generator is not None:
        units["audio_generator"] = _generator_work(cfg, model, flops, "audio_generator")
    return Workload(cfg.name, cfg.seq_len, cfg.llm.vocab_size, cfg.llm.dim, units, int(cfg.loss_chunk))


def _llm_work(cfg: ModelConfig, model, flops) -> UnitWork:
    """The LLM's UnitWork."""
    llm = model.llm
    head_flops = 6.0 * cfg.seq_len * cfg.llm.dim * cfg.llm.vocab_size
    blocks = _count(llm.layers)
    return UnitWork(
        name="llm",
        train_flops=flops["llm"].train,
        flops_not_tp=0.0,  # the head's matmuls split over TP with the vocabulary
        params_tp=blocks,
        params_rep=_count(llm) - blocks,
        trainable_fraction=_trainable((llm, cfg.freeze.llm)),
        items_per_sample=1.0,
        layers=cfg.llm.n_layers,
        tokens=cfg.seq_len,
        dim=cfg.llm.dim,
        heads=cfg.llm.n_heads,
        mlp_ratio=cfg.llm.ffn_dim / cfg.llm.dim,
        gated_mlp=True,
        boundary_floats=cfg.gen_tokens * cfg.llm.dim if cfg.generator is not None else 0,
        kv_heads=cfg.llm.n_kv_heads,
        params_first=_count(llm.tok_embeddings),
        params_last=_count(llm) - blocks - _count(llm.tok_embeddings),
        vocab=cfg.llm.vocab_size,
        vocab_first=_count(llm.tok_embeddings),
        vocab_last=_count(llm.output),
        flops_head=min(head_flops, flops["llm"].train),
        **_moe_work(cfg, llm, _count),
    )


def _encoder_work(cfg: ModelConfig, model, flops) -> UnitWork:
    """The vision encoder's UnitWork (its projector included)."""
    from ..models.vit import vit_block_count

    freeze = cfg.freeze
    vit, proj = model.encoder, model.encoder_projector
    blocks = _count(vit.blocks)
    proj_flops = flops["encoder_projector"].train
    return UnitWork(
        name="encoder",
        train_flops=flops["encoder"].train + proj_flops,
        flops_not_tp=proj_flops,
        params_tp=blocks,
        params_rep=_count(vit) - blocks + _count(proj),
        trainable_fraction=_trainable((vit, freeze.encoder), (proj, freeze.encoder_projector)),
        items_per_sample=float(cfg.nominal_images_per_sample),
        layers=vit_block_count(cfg.encoder),
        tokens=vit.num_patches + int(cfg.encoder.class_token),
        dim=cfg.encoder.dim,
        heads=cfg.encoder.n_heads,
        mlp_ratio=cfg.encoder.mlp_dim / cfg.encoder.dim,
        gated_mlp=False,
        boundary_floats=image_tokens(cfg) * cfg.llm.dim,  # the patches, or the resampler's queries
        params_first=_count(vit) - blocks - _count(vit.norm_post) - _count(vit.proj),
        params_last=_count(vit.norm_post) + _count(vit.proj) + _count(proj),
    )


def _audio_work(cfg: ModelConfig, model, flops) -> UnitWork:
    """The audio tower's UnitWork (its projector included), per clip; the LLM's TP splits its blocks as the ViT's
    where it rides on the LLM unit's first stage (parallel/units.py)."""
    from ..data.audio import audio_tokens

    tokens = audio_tokens(cfg.audio_encoder)
    return _tower_work(cfg, model, flops, "audio_encoder", cfg.nominal_clips_per_sample, tokens, tokens)


def _video_work(cfg: ModelConfig, model, flops) -> UnitWork:
    """The video tower's UnitWork (its projector included), per frame group: temporal_merge frames through the
    ViT (their tokens are the activations and TP traffic), one group of patch embeddings to the LLM."""
    tower, merge = model.video_encoder, int(cfg.video_encoder.temporal_merge)
    groups = cfg.nominal_video_groups_per_sample
    return _tower_work(cfg, model, flops, "video_encoder", groups, tower.tokens_per_image * merge, tower.num_patches)


def _tower_work(cfg: ModelConfig, model, flops, name: str, items: float, tokens: int, sent: int) -> UnitWork:
    """A side tower's UnitWork (``name``: audio_encoder or video_encoder, with its projector): ``items`` per
    sample, ``tokens`` through its blocks and ``sent`` embedding rows to the LLM per item; one stage."""
    spec, proj_name = getattr(cfg, name), name.replace("encoder", "projector")
    tower, proj = getattr(model, name), getattr(model, proj_name)
    blocks = _count(tower.blocks)
    proj_flops = flops[proj_name].train
    frozen = cfg.freeze
    return UnitWork(
        name=name,
        train_flops=flops[name].train + proj_flops,
        flops_not_tp=proj_flops,
        params_tp=blocks,
        params_rep=_count(tower) - blocks + _count(proj),
        trainable_fraction=_trainable((tower, getattr(frozen, name)), (proj, getattr(frozen, proj_name))),
        items_per_sample=float(items),
        layers=spec.n_layers,
        tokens=tokens,
        dim=spec.dim,
        heads=spec.n_heads,
        mlp_ratio=spec.mlp_dim / spec.dim,
        gated_mlp=False,
        boundary_floats=sent * cfg.llm.dim,
        params_first=_count(tower) - blocks + _count(proj),
    )


def _generator_work(cfg: ModelConfig, model, flops, name: str = "generator") -> UnitWork:
    """A U-Net generator's UnitWork (its projector included; activations counted, planner/activation_count.py):
    the image generator's, or (``name="audio_generator"``) the audio generator's, which rides on the LLM's last
    stage and is never cut into pipeline stages. TP splits each spatial transformer's attention and feed-forward
    (models/flops.py ``unet_tensor_parallel``): their parameters are params_tp, their share of the U-Net's FLOPs is
    split; its activations are counted whole (an over-estimate under TP)."""
    from ..models.flops import latent_grid, unet_tensor_parallel
    from ..models.unet import level_head_dims
    from ..parallel.generator_stages import cut_floats

    gen = getattr(cfg, name)
    unet, proj = getattr(model, name), getattr(model, f"{name}_projector")
    grid = latent_grid(cfg, gen)
    counts = unet_counts(cfg, grid, gen)
    fp32, counted_mixed = counts["fp32"], {device: counts[device] for device in ("cuda", "cpu")}
    share, reduces, reduce_floats = unet_tensor_parallel(cfg, gen)
    pieces = _unet_pieces(unet.unet, proj)
    split_params = sum(split for _, split in pieces)
    unet_train, proj_train = flops[name].train, flops[f"{name}_projector"].train
    attended = [level for level, on in enumerate(gen.cross_attention_blocks) if on] + [len(gen.block_out_channels) - 1]
    heads = math.gcd(*(gen.block_out_channels[i] // level_head_dims(gen)[i] for i in attended))
    image = name == "generator"
    frozen = getattr(cfg.freeze, name), getattr(cfg.freeze, f"{name}_projector")
    return UnitWork(
        name=name,
        train_flops=unet_train + proj_train,
        flops_not_tp=unet_train * (1.0 - share) + proj_train,
        params_tp=split_params,
        params_rep=_count(unet) - split_params + _count(proj),
        trainable_fraction=_trainable((unet, frozen[0]), (proj, frozen[1])),
        items_per_sample=1.0,  # every row runs it (weight 0 without a target)
        layers=1,
        tokens=grid[0] * grid[1],
        dim=gen.block_out_channels[0],
        heads=heads,  # the gcd of the transformers' head counts: TP must divide every one (tp_allowed)
        mlp_ratio=0.0,
        gated_mlp=False,
        boundary_floats=0,
        counted_activation_bytes=fp32["none"],
        counted_recompute_bytes={k: v for k, v in fp32.items() if k != "none"},
        counted_mixed=counted_mixed,
        tp_reduces=reduces,
        tp_reduce_floats=reduce_floats,
        pieces=pieces if image else (),
        cut_floats=tuple(cut_floats(unet.unet, cfg)) if image else (),
        params_first=_count(unet) - split_params + _count(proj),
    )


# Bump when what a workload holds or how it is counted changes (invalidates the disk cache).
WORKLOAD_VERSION = 17


def _cache_file(cfg_yaml: str, kind: str = "workloads") -> Path:
    import torch

    return cache_file(kind, f"{WORKLOAD_VERSION}|{torch.__version__}|{cfg_yaml}")


def unet_counts(cfg: ModelConfig, grid: tuple[int, int], unet=None) -> dict[str, dict[str, float]]:
    """A U-Net's activation counts per item (planner/activation_count.py; the image generator's, or ``unet``):
    "fp32", and under bf16 autocast "cuda" and "cpu", each {"none", "full", "selective_op", "largest_block"}.
    About 15 s of fake forwards for SD 2.1's U-Net, and the same U-Net serves many model presets: kept on disk by
    the U-Net's own config."""
    from .activation_count import unet_activation_counts

    unet = cfg.generator if unet is None else unet
    key = OmegaConf.to_yaml(OmegaConf.create({"generator": asdict(unet), "gen_tokens": cfg.gen_tokens}))
    side = grid[0] if grid[0] == grid[1] else f"{grid[0]}x{grid[1]}"  # a square's key as before: the disk cache
    path = _cache_file(f"{key}|side={side}", "unet_counts")
    cached = read_json(path)
    if cached is not None:
        return cached
    out = {}
    for name, mixed, device in (("fp32", False, "cuda"), ("cuda", True, "cuda"), ("cpu", True, "cpu")):
        saved, kept = unet_activation_counts(cfg, grid, mixed, device, unet)
        out[name] = {"none": saved, **kept}
    write_json(path, out)
    return out


@lru_cache(maxsize=16)
def _cached(cfg_yaml: str) -> Workload:
    """Counting a 72B model on meta takes ~10 s; the result is kept on disk by config hash."""
    path = _cache_file(cfg_yaml)
    raw = read_json(path)
    try:
        if raw is not None:
            return Workload(**{**raw, "units": {k: UnitWork(**v) for k, v in raw["units"].items()}})
    except (TypeError, KeyError):
        pass
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.create(cfg_yaml)))
    workload = _build(cfg)
    write_json(path, asdict(workload))
    return workload


def workload_of(model_cfg) -> Workload:
    """The workload of a model config (cached: building 72B on meta takes a few seconds)."""
    node = model_cfg if OmegaConf.is_config(model_cfg) else OmegaConf.structured(model_cfg)
    return _cached(OmegaConf.to_yaml(node))


# What each encoder unit receives of an encoded sample: images, audio clips, video frame groups.
MEASURED_ITEMS = {"encoder": "images", "audio_encoder": "audio", "video_encoder": "video"}


def measured_data(cfg, limit: int = 256) -> tuple[dict[str, float], float] | None:
    """({encoder unit: items per sample it really receives}, CPU seconds to preprocess one sample): the first
    ``limit`` samples of the shards through the trainer's own sample encoder (images, clips and frame groups that
    do not fit the sequence are dropped there, so this can be well below the raw count)."""
    import time

    from ..data.reader import RawSample, resolve_shards
    from ..data.samples import BadSample, SampleEncoder
    from ..data.shard_cursor import read_shard
    from ..data.tokenizer import tokenizer_for

    data = cfg.data
    encoder = SampleEncoder(
        cfg.model, tokenizer_for(cfg), 0, data.max_image_pixels, data.video_frames, data.chat_template
    )
    totals = dict.fromkeys(MEASURED_ITEMS, 0)
    samples = 0
    busy = 0.0
    for shard in resolve_shards(cfg.data.path):
        for item in read_shard(shard):
            if not isinstance(item, RawSample):
                continue
            started = time.process_time()
            try:
                sample = encoder.encode(item.key, item.members)
            except BadSample:
                continue
            finally:
                busy += time.process_time() - started
            samples += 1
            for unit, field in MEASURED_ITEMS.items():
                totals[unit] += len(getattr(sample, field))  # audio and video are empty arrays without a tower
            if samples >= limit:
                break
        if samples >= limit:
            break
    return ({unit: total / samples for unit, total in totals.items()}, busy / samples) if samples else None


def with_items_per_sample(work: Workload, items: dict[str, float]) -> Workload:
    """``work`` with each encoder unit's items per sample replaced by ``items``' (the measured counts)."""
    from dataclasses import replace

    units = {
        name: replace(unit, items_per_sample=items[name]) if name in items else unit
        for name, unit in work.units.items()
    }
    return replace(work, units=units)
