"""Every context-parallel mode (parallel.cp_mode: ring, allgather, ulysses, hybrid; comm/context_modes.py) equals
attention over the whole sequence, forward and backward (fp32, outputs and q/k/v gradients within 1e-5), on 2 and
4 ranks: a length that does not divide into the chunks (padded), grouped-query attention (Ulysses with key/value
heads split, and replicated where there are fewer of them than ranks), and packed documents under both document
kernels (varlen, dense). Hybrid runs at cp = 4 as 2 ring ranks of 2 Ulysses ranks."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .spawn import start_processes

pytestmark = pytest.mark.distributed

SEQ = 29  # pads to 32 (cp 2: 4 chunks of 8; cp 4: 8 chunks of 4)
HEAD_DIM = 8


def _attention(heads: int, kv_heads: int, kernel: str):
    from disttrain_core.config import LlamaConfig
    from disttrain_core.models.llama import Attention

    cfg = LlamaConfig(vocab_size=8, dim=heads * HEAD_DIM, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=8)
    module = Attention(cfg)
    module.document_kernel = kernel
    return module


def _reference(q, k, v, upstream, ids):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    seq = q.shape[2]
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    if ids is not None:
        mask = (ids[:, :, None] == ids[:, None, :]) & mask
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask[:, None] if ids is not None else mask, enable_gqa=True)
    (out * upstream).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _case_errors(slices, heads: int, kv_heads: int, packed: bool, kernel: str) -> torch.Tensor:
    from disttrain_core.models.llama import Documents
    from disttrain_core.parallel.context_parallel import apply_context_parallel

    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(2, heads, SEQ, HEAD_DIM, generator=g)
    k, v = (torch.randn(2, kv_heads, SEQ, HEAD_DIM, generator=g) for _ in range(2))
    upstream = torch.randn(q.shape, generator=g)
    ids = torch.tensor([[0] * 6 + [1] * 15 + [2] * 8, [0] * 3 + [1] * 26]) if packed else None
    reference = _reference(q, k, v, upstream, ids)
    module = _attention(heads, kv_heads, kernel)
    apply_context_parallel(module, slices)
    pad, positions = slices.padded - SEQ, slices.positions
    real = positions < SEQ

    def local(t, fill=1e3):  # padded keys hold garbage on purpose: causality keeps them out of real queries
        return F.pad(t, (0, 0, 0, pad), value=fill)[:, :, positions].contiguous().requires_grad_(True)

    leaves = [local(t) for t in (q, k, v)]
    documents = slices.documents(Documents(ids, torch.zeros_like(ids))) if packed else None
    out = module.core_attention(*leaves, documents)
    (out * local(upstream, 0.0)).sum().backward()
    keep = positions[real]
    mine = [out.detach()] + [t.grad for t in leaves]
    return torch.stack([(a[:, :, real] - b[:, :, keep]).abs().max() for a, b in zip(mine, reference, strict=True)])


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    from disttrain_core.parallel.context_parallel import SequenceSlices

    group = dist.group.WORLD
    modes = {m: SequenceSlices(group, SEQ, mode=m) for m in ("ring", "allgather", "ulysses")}
    if world == 4:  # 2 ring ranks of 2 Ulysses ranks: every rank creates every group, in the same order
        ulysses = [dist.new_group(r) for r in ([0, 1], [2, 3])][rank // 2]
        ring = [dist.new_group(r) for r in ([0, 2], [1, 3])][rank % 2]
        modes["hybrid"] = SequenceSlices(group, SEQ, mode="hybrid", ulysses_group=ulysses, ring_group=ring)
    errors = {}
    for mode, slices in modes.items():
        for heads, kv_heads in ((4, 2), (4, 4), (8, 1)):
            errors[f"{mode}-h{heads}kv{kv_heads}"] = _case_errors(slices, heads, kv_heads, False, "varlen")
        for kernel in ("varlen", "dense"):
            errors[f"{mode}-packed-{kernel}"] = _case_errors(slices, 4, 2, True, kernel)
    torch.save(errors, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_every_context_parallel_mode_matches_full_attention(tmp_path, world):
    start_processes(_worker, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        errors = torch.load(tmp_path / f"{rank}.pt", weights_only=True)
        assert len(errors) == (20 if world == 4 else 15)
        for case, error in errors.items():
            assert error.max().item() < 1e-5, (rank, case, error.tolist())
