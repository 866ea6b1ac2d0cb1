"""What each parallelism unit has to compute and store, read off the model config.

Everything comes from the real modules built on the meta device (parameter counts)
and from the FLOP counter (models/flops.py), so the planner and the trainer agree
on the model; nothing is estimated from a formula that could drift from the code.

Work is counted per *item*: the encoder per image, the LLM per sequence, the
generator per sample. ``items_per_sample`` turns samples into items (images per
sample for the encoder, from ``model.nominal_images_per_sample``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from omegaconf import OmegaConf

from ..config import ModelConfig

UNIT_NAMES = ("encoder", "llm", "generator")


@dataclass(frozen=True)
class UnitWork:
    name: str
    train_flops: float  # forward + backward FLOPs per item
    flops_not_tp: float  # the part tensor parallelism does not split (replicated modules, the projectors)
    params_tp: int  # parameters inside transformer blocks (sharded by TP)
    params_rep: int  # parameters outside the blocks (embeddings, norms, head, projector, U-Net); replicated in a
    # TP group but for the vocabulary rows (vocab_first, vocab_last)
    trainable_fraction: float  # share of the parameters that have gradients and optimizer states
    items_per_sample: float
    layers: int  # transformer blocks (pipeline stages split these); 1 for the U-Net
    tokens: int  # tokens per item (patches per image, seq_len per sequence, latent cells per sample)
    dim: int  # block width (activation rows)
    heads: int
    mlp_ratio: float  # MLP hidden / dim
    gated_mlp: bool  # SwiGLU (three matrices) or GELU (two)
    boundary_floats: int  # floats per item sent to the next unit (0 for the last)
    # U-Net: bytes saved for backward per item in fp32 (counted on fake CPU tensors, planner/activation_count.py);
    # the same under full / selective_op and its largest block
    counted_activation_bytes: float = 0.0
    counted_recompute_bytes: dict = field(default_factory=dict)
    # ... and under bf16 autocast, per device kind ("cuda", "cpu": their autocast policies differ): {"none", "full",
    # "selective_op", "largest_block"}
    counted_mixed: dict = field(default_factory=dict)
    # Units whose TP-split blocks differ in width (the U-Net's transformers, one per level): the all-reduces one
    # item's training step runs and the elements they carry (0: ``4 layers`` all-reduces of tokens x dim)
    tp_reduces: int = 0
    tp_reduce_floats: float = 0.0
    kv_heads: int = 0  # grouped-query attention (LLM)
    # Of params_rep, what the first pipeline stage holds (embeddings) and the last (final norm, head,
    # projector); the blocks split evenly. params_rep = params_first + params_last.
    params_first: int = 0
    params_last: int = 0
    # Mixture of experts (LLM with ``llm.moe``; all 0 for dense units). Of params_tp, the routed experts
    # (expert parallelism holds experts/ep of them, TP splits each one's hidden width) and the routers, which
    # every TP rank holds and runs whole (parallel/tensor_parallel.py); the shared experts split like dense MLPs.
    params_expert: int = 0
    params_moe_rep: int = 0
    flops_moe: float = 0.0  # forward + backward FLOPs per item of the MoE routers (TP does not split them)
    num_experts: int = 0
    top_k: int = 0
    expert_dim: int = 0  # hidden width of one expert
    shared_experts: int = 0
    # Vocabulary parallelism (LLM): of params_first / params_last, the embedding's and the head's rows, which
    # tensor parallelism splits (parallel/tensor_parallel.py apply_vocab_parallel); vocab: their row count
    vocab: int = 0
    vocab_first: int = 0
    vocab_last: int = 0
    flops_head: float = 0.0  # forward + backward FLOPs per item of the head (split by TP, never recomputed)

    @property
    def params(self) -> int:
        return self.params_tp + self.params_rep

    @property
    def params_dense_tp(self) -> int:
        """Block parameters TP shards outside the routed experts: attention, dense MLPs, shared experts."""
        return self.params_tp - self.params_expert - self.params_moe_rep

    @property
    def flops_unsplit(self) -> float:
        """FLOPs per item TP does not divide: the replicated modules and the MoE routers."""
        return self.flops_not_tp + self.flops_moe

    def active_params(self) -> float:
        """Parameters one token uses: all but the routed experts it is not sent to (top_k of num_experts)."""
        if not self.num_experts:
            return float(self.params)
        return self.params - self.params_expert * (1.0 - self.top_k / self.num_experts)

    def tp_allowed(self, tp: int) -> bool:
        """Can the runtime shard this unit's blocks over ``tp`` devices (heads, KV heads, MLP width)?"""
        if tp == 1:
            return True
        if not self.params_tp:
            return False  # nothing to split: TP would only cost devices
        hidden = round(self.dim * self.mlp_ratio)
        return (
            self.heads % tp == 0
            and hidden % tp == 0
            and (not self.kv_heads or self.kv_heads % tp == 0)
            and (not self.vocab or self.vocab % tp == 0)
            and (not self.num_experts or self.expert_dim % tp == 0)
        )

    def rep_local(self, tp: int, part: str = "all") -> float:
        """Of the parameters outside the blocks (``part``: "first", "last" or "all"), what one TP rank holds:
        the vocabulary rows 1/tp, the rest whole."""
        held, vocab = {
            "first": (self.params_first, self.vocab_first),
            "last": (self.params_last, self.vocab_last),
            "all": (self.params_rep, self.vocab_first + self.vocab_last),
        }[part]
        return held - vocab + vocab / tp


@dataclass(frozen=True)
class Workload:
    model: str
    seq_len: int
    vocab: int
    llm_dim: int
    units: dict[str, UnitWork]
    loss_chunk: int = 0  # model.loss_chunk: positions of logits held at once (0: all of them)

    def get(self, name: str) -> UnitWork | None:
        return self.units.get(name)


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
        boundary_floats=vit.num_patches * cfg.llm.dim,
        params_first=_count(vit) - blocks - _count(vit.norm_post) - _count(vit.proj),
        params_last=_count(vit.norm_post) + _count(vit.proj) + _count(proj),
    )


def _generator_work(cfg: ModelConfig, model, flops) -> UnitWork:
    """The U-Net generator's UnitWork (its projector included; activations counted, planner/activation_count.py).
    TP splits each spatial transformer's attention and feed-forward (models/flops.py ``unet_tensor_parallel``):
    their parameters are params_tp, their share of the U-Net's FLOPs is split; its activations are counted whole
    (an over-estimate under TP)."""
    from ..models.flops import unet_tensor_parallel
    from ..models.unet import level_head_dims

    freeze = cfg.freeze
    unet, proj = model.generator, model.generator_projector
    side = cfg.gen_image_size // cfg.latent_downsample
    counts = unet_counts(cfg, side)
    fp32, counted_mixed = counts["fp32"], {device: counts[device] for device in ("cuda", "cpu")}
    share, split_params, reduces, reduce_floats = unet_tensor_parallel(cfg)
    unet_train = flops["generator"].train
    gen = cfg.generator
    attended = [level for level, on in enumerate(gen.cross_attention_blocks) if on] + [len(gen.block_out_channels) - 1]
    heads = math.gcd(*(gen.block_out_channels[i] // level_head_dims(gen)[i] for i in attended))
    return UnitWork(
        name="generator",
        train_flops=unet_train + flops["generator_projector"].train,
        flops_not_tp=unet_train * (1.0 - share) + flops["generator_projector"].train,
        params_tp=split_params,
        params_rep=_count(unet) - split_params + _count(proj),
        trainable_fraction=_trainable((unet, freeze.generator), (proj, freeze.generator_projector)),
        items_per_sample=1.0,
        layers=1,
        tokens=side * side,
        dim=cfg.generator.block_out_channels[0],
        heads=heads,  # the gcd of the transformers' head counts: TP must divide every one (tp_allowed)
        mlp_ratio=0.0,
        gated_mlp=False,
        boundary_floats=0,
        counted_activation_bytes=fp32["none"],
        counted_recompute_bytes={k: v for k, v in fp32.items() if k != "none"},
        counted_mixed=counted_mixed,
        tp_reduces=reduces,
        tp_reduce_floats=reduce_floats,
        params_first=_count(unet) - split_params + _count(proj),
    )


# Bump when what a workload holds or how it is counted changes (invalidates the disk cache).
WORKLOAD_VERSION = 11


def _cache_file(cfg_yaml: str, kind: str = "workloads") -> Path:
    import torch

    root = Path(os.environ.get("DISTTRAIN_CACHE", Path.home() / ".cache" / "disttrain"))
    key = hashlib.sha256(f"{WORKLOAD_VERSION}|{torch.__version__}|{cfg_yaml}".encode()).hexdigest()[:24]
    return root / kind / f"{key}.json"


def _write_json(path: Path, value) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
    except OSError:
        pass


def unet_counts(cfg: ModelConfig, side: int) -> dict[str, dict[str, float]]:
    """The U-Net's activation counts per item (planner/activation_count.py): "fp32", and under bf16 autocast
    "cuda" and "cpu", each {"none", "full", "selective_op", "largest_block"}. About 15 s of fake forwards for
    SD 2.1's U-Net, and the same U-Net serves many model presets: kept on disk by the U-Net's own config."""
    from .activation_count import unet_activation_counts

    key = OmegaConf.to_yaml(OmegaConf.create({"generator": asdict(cfg.generator), "gen_tokens": cfg.gen_tokens}))
    path = _cache_file(f"{key}|side={side}", "unet_counts")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    out = {}
    for name, mixed, device in (("fp32", False, "cuda"), ("cuda", True, "cuda"), ("cpu", True, "cpu")):
        saved, kept = unet_activation_counts(cfg, side, mixed, device)
        out[name] = {"none": saved, **kept}
    _write_json(path, out)
    return out


@lru_cache(maxsize=16)
def _cached(cfg_yaml: str) -> Workload:
    """Counting a 72B model on meta takes ~10 s; the result is kept on disk by config hash."""
    path = _cache_file(cfg_yaml)
    try:
        raw = json.loads(path.read_text())
        return Workload(**{**raw, "units": {k: UnitWork(**v) for k, v in raw["units"].items()}})
    except (OSError, ValueError, TypeError, KeyError):
        pass
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.create(cfg_yaml)))
    workload = _build(cfg)
    _write_json(path, asdict(workload))
    return workload


def workload_of(model_cfg) -> Workload:
    """The workload of a model config (cached: building 72B on meta takes a few seconds)."""
    node = model_cfg if OmegaConf.is_config(model_cfg) else OmegaConf.structured(model_cfg)
    return _cached(OmegaConf.to_yaml(node))


def measured_data(cfg, limit: int = 256) -> tuple[float, float] | None:
    """(images per sample the encoder really receives, CPU seconds to preprocess one sample):
    the first ``limit`` samples of the shards through the trainer's own sample encoder (images
    that do not fit the sequence are dropped there, so this can be well below the raw count)."""
    import time

    from ..data.reader import RawSample, _read_shard, resolve_shards
    from ..data.samples import BadSample, SampleEncoder
    from ..data.tokenizer import build_tokenizer

    encoder = SampleEncoder(cfg.model, build_tokenizer(cfg.data.tokenizer), 0, cfg.data.max_image_pixels)
    counts = []
    busy = 0.0
    for shard in resolve_shards(cfg.data.path):
        for item in _read_shard(shard):
            if not isinstance(item, RawSample):
                continue
            started = time.process_time()
            try:
                counts.append(len(encoder.encode(item.key, item.members).images))
            except BadSample:
                continue
            finally:
                busy += time.process_time() - started
            if len(counts) >= limit:
                break
        if len(counts) >= limit:
            break
    return (sum(counts) / len(counts), busy / len(counts)) if counts else None


def with_images_per_sample(work: Workload, images: float) -> Workload:
    from dataclasses import replace

    if "encoder" not in work.units:
        return work
    units = {**work.units, "encoder": replace(work.units["encoder"], items_per_sample=images)}
    return replace(work, units=units)
