"""Activation recompute, applied from outside the model like tensor parallelism.

Policies (``parallel.recompute`` / ``parallel.units.<unit>.recompute``), per block -- a Llama decoder
block, a ViT block, a U-Net residual block or spatial transformer:

* ``none``: autograd keeps every activation the backward needs;
* ``full``: a block keeps only its inputs; its forward runs again inside the backward, so while one
  block's backward runs its activations exist again (one block's worth, transiently);
* ``selective_op``: inside each block the outputs of matmuls, attention and collectives are kept and
  everything else (norms, rotary embeddings, activations, elementwise products) is recomputed --
  TorchTitan's op-level selective checkpointing (``torch.utils.checkpoint`` with a policy);
* ``every_k``: full recompute of every k-th block of a stage (``recompute_every``), none for the rest;
* ``full_partitioned``: ``full`` with each block's kept input split over the tensor-parallel group (ZeRO-R's
  partitioned activation checkpoints), gathered again before the block reruns (parallel/saved_activations.py);
* ``offload``: nothing recomputed; every block's saved activations wait in host memory, copied there and back
  while other blocks compute (parallel/saved_activations.py ``HostOffload``).

A block's ``forward`` is wrapped on the instance with non-reentrant ``torch.utils.checkpoint``, so
parameter names (and checkpoints, and the seeded initialization) do not change, hooks on the block
still run once per forward, and the wrapper composes with the chunked TP forward (comm/tp_overlap.py)
and the pipeline's split backward. Results equal no recompute: the same operations run on the same
values (the recomputation replays the autocast state; the blocks draw no random numbers, so no RNG
state is kept per call).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..models.llama import DecoderBlock
from ..models.unet import ResBlock, SpatialTransformer
from ..models.vit import VitBlock
from .saved_activations import HostOffload, TpPartition

POLICIES = ("none", "full", "selective_op", "every_k", "full_partitioned", "offload")
NEEDS_TP = ("full_partitioned",)  # a policy that splits over the TP group: tp > 1, no sequence parallelism
FAMILIES = ((DecoderBlock,), (VitBlock,), (ResBlock, SpatialTransformer))  # every_k counts within each
BLOCKS = tuple(kind for family in FAMILIES for kind in family)

aten = torch.ops.aten
# Kept under selective_op: what is expensive to recompute (matmuls, attention, convolutions) or must
# not run twice (collectives).
_SAVED = {
    aten.mm,
    aten.addmm,
    aten.bmm,
    aten.baddbmm,
    aten.convolution,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
}
for _name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"):
    _op = getattr(torch.ops._c10d_functional, _name, None)
    if _op is not None:
        _SAVED.add(_op)


def _keep_matmuls(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    packet = getattr(func, "overloadpacket", func)
    return CheckpointPolicy.MUST_SAVE if packet in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_matmuls)


def _wrap(block: nn.Module, context_fn: Callable | None, partition: TpPartition | None = None) -> None:
    inner = block.forward  # bound; may already be the chunked TP forward
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}

    @functools.wraps(inner)
    def forward(*args, **kw):
        # No block draws random numbers (no dropout), so the RNG state need not be saved per call.
        if partition is None:
            return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=False, **kwargs, **kw)
        with partition.hooks():  # the checkpoint saves its inputs through these: 1/tp of each kept
            return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=False, **kwargs, **kw)

    block.forward = forward
    block._recompute = True


def apply_recompute(module: nn.Module, policy: str, every: int = 1, tp_group=None):
    """Wrap the blocks of ``module`` for ``policy``; returns how many blocks recompute (or offload), or for
    ``offload`` and ``full_partitioned`` the hooks' object (``HostOffload``, ``TpPartition``: their byte counts).
    ``tp_group``: the blocks' tensor-parallel group (``full_partitioned``)."""
    if policy not in POLICIES:
        raise ValueError(f"recompute={policy!r}: allowed values are {', '.join(POLICIES)}")
    if policy == "none":
        return 0
    if every < 1:
        raise ValueError(f"recompute_every={every}: use 1 or more")
    blocks = []
    for family in FAMILIES:  # LLM blocks, ViT blocks, U-Net blocks: every k-th of each, in definition order
        members = [m for m in module.modules() if isinstance(m, family)]
        blocks += members[:: every if policy == "every_k" else 1]
    if policy == "offload":
        offload = HostOffload()
        for index, block in enumerate(blocks):
            offload.wrap(block, index)
        return offload
    if policy == "full_partitioned" and tp_group is None:
        raise ValueError("recompute=full_partitioned splits each block's input over the TP group: none was given")
    partition = TpPartition(tp_group) if policy == "full_partitioned" else None
    context_fn = _selective_contexts if policy == "selective_op" else None
    for block in blocks:
        _wrap(block, context_fn, partition)
    return partition if partition is not None else len(blocks)
