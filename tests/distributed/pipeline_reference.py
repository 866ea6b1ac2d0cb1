"""Shared by the pipeline tests: the microbatches of one step and the single-process reference."""

from __future__ import annotations

import torch

from disttrain_core.data.loader import MicrobatchLoader
from disttrain_core.data.reader import ShardStream, resolve_shards
from disttrain_core.data.samples import SampleEncoder
from disttrain_core.data.tokenizer import ByteTokenizer


def microbatches(cfg, count: int = 8, size: int = 2):
    loader = MicrobatchLoader(
        ShardStream(resolve_shards(cfg.data.path), 0, 1, seed=cfg.trainer.seed),
        SampleEncoder(cfg.model, ByteTokenizer(), cfg.trainer.seed, cfg.data.max_image_pixels, cfg.data.video_frames),
        micro_batch_size=size,
        microbatches_per_step=count,
    )
    batches = loader.next_step()
    n_tokens = float(sum(b.loss_tokens() for b in batches))
    n_gen = max(float(sum(b.gen_samples() for b in batches)), 1.0)
    return batches, n_tokens, n_gen


def loss_of(out: dict, n_tokens: float, n_gen: float, weight: float) -> torch.Tensor:
    loss = out["lm_loss_sum"] / n_tokens if "lm_loss_sum" in out else 0.0
    if "gen_loss_sum" in out:
        loss = loss + weight * out["gen_loss_sum"] / n_gen
    return loss


def reference(cfg):
    """Loss sums and gradients of the whole model on one process."""
    from disttrain_core.models import build_model, materialize

    batches, n_tokens, n_gen = microbatches(cfg)
    model = build_model(cfg.model, ByteTokenizer())
    materialize(model, "cpu", seed=cfg.trainer.seed, std=cfg.model.init_std)
    sums = {"lm_loss_sum": 0.0, "gen_loss_sum": 0.0}
    for batch in batches:
        out = model(batch)
        loss_of(out, n_tokens, n_gen, cfg.model.gen_loss_weight).backward()
        for name in sums:
            if name in out:
                sums[name] += float(out[name].detach())
    return sums, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
