"""Running a hot-switch plan (switch_plan.py): every rank packs what it sends to each peer into one buffer,
posts all its sends and receives as one batched call, waits on every handle, and unpacks.

NCCL's contract (comm/p2p.py): one batched call per switch, every handle it returns waited on before a
received byte is read; buffers are fresh and contiguous (gloo silently mis-receives into non-contiguous
tensors). Peak extra memory is the fused send buffers plus the fused receive buffers of this rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.p2p import post, wait_all
from .switch_plan import Box, SwitchPlan


def region(tensor: torch.Tensor, held: Box, cell: Box) -> torch.Tensor:
    """The part of ``tensor`` (which holds box ``held`` of its parameter) covering ``cell``."""
    index = tuple(slice(c0 - h0, c1 - h0) for (h0, _), (c0, c1) in zip(held, cell, strict=True))
    return tensor[index]


def _dtype(tensors) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"a switch moves tensors of one dtype; got {sorted(map(str, dtypes))}")
    return dtypes.pop() if dtypes else torch.float32


def run_switch(
    plan: SwitchPlan,
    source: dict[str, torch.Tensor],
    src: dict[str, dict[int, Box]],
    dst: dict[str, dict[int, Box]],
    group=None,
    into: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's tensors under the target layout, built from ``source`` (its tensors under the source
    layout, keyed by name; only those it holds), written into ``into`` when given (the target's live
    tensors, shaped as its boxes) or into new tensors. Every rank of ``group`` calls it with the same plan."""
    single = not dist.is_initialized()  # one process: every transfer is local
    group = group if group is not None or single else dist.group.WORLD
    rank = 0 if single else dist.get_rank(group)
    dtype = _dtype(source.values())
    device = next(iter(source.values())).device if source else torch.device("cpu")
    out = (
        into
        if into is not None
        else {
            name: torch.empty([b - a for a, b in boxes[rank]], dtype=dtype, device=device)
            for name, boxes in dst.items()
            if rank in boxes
        }
    )
    for t in plan.local:
        if t.receiver == rank:
            region(out[t.name], dst[t.name][rank], t.box).copy_(region(source[t.name], src[t.name][rank], t.box))
    to, frm = plan.peers(rank)
    ops, inbound = [], []
    for peer in to:
        parts = [region(source[t.name], src[t.name][rank], t.box).reshape(-1) for t in plan.messages[(rank, peer)]]
        buffer = torch.cat(parts)  # one fused, contiguous message per peer
        ops.append(dist.P2POp(dist.isend, buffer, dist.get_global_rank(group, peer), group=group))
    for peer in frm:
        buffer = torch.empty(plan.message_numel(peer, rank), dtype=dtype, device=device)
        inbound.append((peer, buffer))
        ops.append(dist.P2POp(dist.irecv, buffer, dist.get_global_rank(group, peer), group=group))
    wait_all(post(ops))
    for peer, buffer in inbound:
        offset = 0
        for t in plan.messages[(peer, rank)]:
            target = region(out[t.name], dst[t.name][rank], t.box)
            target.copy_(buffer[offset : offset + t.numel].view(target.shape))
            offset += t.numel
    return out
