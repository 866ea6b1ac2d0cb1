"""Peak live tensor bytes of one ring-attention call against one SDPA call of the same local shape, on CPU.

``cp`` gloo processes (one thread each) each hold [1, heads, S, head_dim] queries and [1, kv_heads, S, head_dim]
keys/values (S = ``lengths`` positions per rank, fp32) and measure, with a tensor-bytes counter
(planner/activation_count.py ``LiveTensorBytes``: every storage an operator creates, from creation until freed,
plus the inputs), the peak while

* ``forward``: one causal attention call: ``ring_attention`` over the cp ranks, or causal SDPA on the same
  local tensors (what one rank would run without context parallelism);
* ``forward_backward``: the call and its backward (the saved tensors, the upstream gradient, the gradients).

Ratios are ring / SDPA on the same rank (the larger of the ranks). Kernels' private scratch is invisible to
the counter (in both). Transfers honour NCCL's buffers, not the test suite's strict-p2p staging copies.

    python tools/ring_attention_memory.py                       # 2K/4K/8K positions per rank, cp=2
    python tools/ring_attention_memory.py lengths=8192 cp=2 format=json
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from disttrain_core.config import REPO_ROOT
from disttrain_core.launch.cli import tool_main, tool_options

OPTIONS = {
    "lengths": "2048,4096,8192",  # positions per rank
    "cp": "2",
    "heads": "4",
    "kv_heads": "2",
    "head_dim": "64",
    "format": "text",
    "out": str(REPO_ROOT / "docs" / "results" / "ring_attention_memory.json"),
}


def _peaks(attend, q, k, v, upstream) -> dict[str, float]:
    from disttrain_core.planner.activation_count import LiveTensorBytes

    inputs = sum(t.untyped_storage().nbytes() for t in (q, k, v))
    with LiveTensorBytes(inputs) as forward:
        out = attend(q, k, v)
    del out
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with LiveTensorBytes(inputs + upstream.untyped_storage().nbytes()) as both:
        attend(*leaves).backward(upstream)
    return {"forward": forward.peak, "forward_backward": both.peak, "inputs": float(inputs)}


def _worker(rank: int, world: int, store: str, out_dir: str, settings: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.pop("DISTTRAIN_STRICT_P2P", None)  # NCCL's receive buffers, not the suite's staging copies
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    from disttrain_core.comm.ring import Ring
    from disttrain_core.comm.ring_attention import ring_attention

    ring = Ring(dist.group.WORLD)
    rows = []
    for length in settings["lengths"]:
        g = torch.Generator().manual_seed(length + rank)
        q = torch.randn(1, settings["heads"], length, settings["head_dim"], generator=g)
        k, v = (torch.randn(1, settings["kv_heads"], length, settings["head_dim"], generator=g) for _ in range(2))
        upstream = torch.randn(q.shape, generator=g)
        sdpa = _peaks(
            lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
            ),
            q,
            k,
            v,
            upstream,
        )
        dist.barrier()
        ring_peaks = _peaks(lambda q, k, v: ring_attention(q, k, v, ring), q, k, v, upstream)
        rows.append({"length": length, "sdpa": sdpa, "ring": ring_peaks})
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def measure(lengths: list[int], cp: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 64) -> list[dict]:
    """Per length: each phase's peak bytes (the larger rank) of ring attention and SDPA, and their ratio."""
    settings = {"lengths": lengths, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker, args=(cp, os.path.join(tmp, "store"), tmp, settings), nprocs=cp, join=True, start_method="spawn"
        )
        ranks = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(cp)]
    out = []
    for index, length in enumerate(lengths):
        row = {"positions_per_rank": length, "cp": cp, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
        for phase in ("forward", "forward_backward"):
            ring = max(r[index]["ring"][phase] for r in ranks)
            sdpa = max(r[index]["sdpa"][phase] for r in ranks)
            row[phase] = {"ring_bytes": ring, "sdpa_bytes": sdpa, "ratio": ring / sdpa}
        out.append(row)
    return out


def main(argv: list[str]) -> int:
    options = tool_options(argv, OPTIONS)
    lengths = [int(x) for x in options["lengths"].split(",")]
    rows = measure(
        lengths, int(options["cp"]), int(options["heads"]), int(options["kv_heads"]), int(options["head_dim"])
    )
    report = {"machine": {"torch": torch.__version__, "device": "cpu"}, "rows": rows}
    if options["out"] != "none":
        with open(options["out"], "w") as f:
            json.dump(report, f, indent=1)
    if options["format"] == "json":
        print(json.dumps(report, indent=1))
        return 0
    for row in rows:
        f, b = row["forward"], row["forward_backward"]
        print(
            f"{row['positions_per_rank']:>6} positions/rank cp={row['cp']}: forward ring "
            f"{f['ring_bytes'] / 2**20:7.1f} "
            f"MiB vs SDPA {f['sdpa_bytes'] / 2**20:7.1f} MiB ({f['ratio']:.2f}x); forward+backward "
            f"{b['ring_bytes'] / 2**20:7.1f} vs {b['sdpa_bytes'] / 2**20:7.1f} MiB ({b['ratio']:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(tool_main(main, sys.argv[1:]))
