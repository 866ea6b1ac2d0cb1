"""The chunked ring matmuls of sequence-parallel TP equal the unchunked computation, forward and
backward, on 3 ranks (an odd ring catches a wrong direction or block order)."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from .spawn import start_processes

pytestmark = pytest.mark.distributed

WORLD, BATCH, SEQ, DIM, OUT = 3, 2, 6, 5, 4


def _worker(rank: int, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    from disttrain_core.comm.tp_overlap import AllGatherMatmul, MatmulReduceScatter, Ring

    ring = Ring(dist.group.WORLD)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, SEQ, DIM, generator=g, dtype=torch.float64)
    w_col = torch.randn(OUT * WORLD, DIM, generator=g, dtype=torch.float64)  # column parallel: rows split
    w_row = torch.randn(DIM, OUT * WORLD, generator=g, dtype=torch.float64)  # row parallel: columns split
    h = torch.randn(BATCH, SEQ, OUT * WORLD, generator=g, dtype=torch.float64)
    seq = slice(rank * SEQ // WORLD, (rank + 1) * SEQ // WORLD)
    cols = slice(rank * OUT, (rank + 1) * OUT)

    # all-gather + matmul: this rank's sequence chunk in, every position of its output columns out.
    x_part = x[:, seq].clone().requires_grad_(True)
    w_part = w_col[cols].clone().requires_grad_(True)
    (y,) = AllGatherMatmul.apply(ring, x_part, w_part)
    upstream = torch.randn(BATCH, SEQ, OUT * WORLD, generator=g, dtype=torch.float64)
    (y * upstream[..., cols]).sum().backward()
    reference_x = x.clone().requires_grad_(True)
    reference_w = w_col.clone().requires_grad_(True)
    (torch.nn.functional.linear(reference_x, reference_w) * upstream).sum().backward()
    errors = [
        (y - (x @ w_col.t())[..., cols]).abs().max(),
        (x_part.grad - reference_x.grad[:, seq]).abs().max(),
        (w_part.grad - reference_w.grad[cols]).abs().max(),
    ]

    # matmul + reduce-scatter: this rank's columns in, its sequence chunk of the summed output out.
    h_part = h[..., cols].clone().requires_grad_(True)
    v_part = w_row[:, cols].clone().requires_grad_(True)
    z = MatmulReduceScatter.apply(ring, h_part, v_part)
    down = torch.randn(BATCH, SEQ, DIM, generator=g, dtype=torch.float64)
    (z * down[:, seq]).sum().backward()
    reference_h = h.clone().requires_grad_(True)
    reference_v = w_row.clone().requires_grad_(True)
    (torch.nn.functional.linear(reference_h, reference_v) * down).sum().backward()
    errors += [
        (z - (h @ w_row.t())[:, seq]).abs().max(),
        (h_part.grad - reference_h.grad[..., cols]).abs().max(),
        (v_part.grad - reference_v.grad[:, cols]).abs().max(),
    ]
    torch.save(torch.stack(errors), os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def test_ring_matmuls_match_the_unchunked_computation(tmp_path):
    start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        errors = torch.load(tmp_path / f"{rank}.pt", weights_only=True)
        assert errors.max().item() < 1e-12, (rank, errors.tolist())
