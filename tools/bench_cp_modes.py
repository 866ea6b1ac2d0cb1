"""Every context-parallel mode (parallel.cp_mode; comm/context_modes.py) on this machine: the busiest rank's time
and the peak live tensor bytes of one attention core's forward + backward, at each number of positions per rank.

``cp`` gloo processes (one thread each) each hold [1, heads, S, head_dim] fp32 queries and [1, kv_heads, S,
head_dim] keys/values of their own positions (S = ``positions`` per rank) and run, through
``apply_context_parallel`` on one Llama attention module, each mode in ``modes`` (hybrid needs cp >= 4: 2 ranks per
all-to-all). Per mode: the median wall time over ``repeats`` (after ``warmup``) of forward + backward on each rank,
the busiest rank's reported, and the peak bytes of the tensors alive on a rank during one forward + backward
(planner/activation_count.py ``LiveTensorBytes``: every storage an operator creates, plus the inputs; the larger
rank's). Ratios are against the ring in the same run.

This machine has 2 cores and gloo over loopback: cp = 2 runs one process per core; the time includes the
collectives' copies over loopback, not NVLink. The all-gather and Ulysses modes overlap nothing with compute here
or on a GPU (their collectives are blocking), the ring overlaps its hops with the blocks' attention.

    python tools/bench_cp_modes.py                                  # 8K and 32K positions per rank, cp=2
    python tools/bench_cp_modes.py positions=2048 cp=4 modes=ring,allgather,ulysses,hybrid format=json
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from disttrain_core.config import REPO_ROOT
from disttrain_core.launch.cli import tool_main, tool_options

OPTIONS = {
    "positions": "8192,32768",  # per rank
    "cp": "2",
    "modes": "ring,allgather,ulysses",
    "heads": "4",
    "kv_heads": "2",
    "head_dim": "32",
    "repeats": "3",
    "warmup": "1",
    "timeout_s": "600",
    "format": "text",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_cp_modes.json"),
}


def _slices(mode: str, world: int, seq_len: int, groups: dict):
    from disttrain_core.parallel.context_parallel import SequenceSlices

    if mode != "hybrid":
        return SequenceSlices(dist.group.WORLD, seq_len, mode=mode)
    return SequenceSlices(dist.group.WORLD, seq_len, mode=mode, ulysses_group=groups["u"], ring_group=groups["r"])


def _measure(mode: str, slices, settings: dict, length: int) -> dict:
    from disttrain_core.config import LlamaConfig
    from disttrain_core.models.llama import Attention
    from disttrain_core.parallel.context_parallel import apply_context_parallel
    from disttrain_core.planner.activation_count import LiveTensorBytes

    heads, kv_heads, dim = settings["heads"], settings["kv_heads"], settings["head_dim"]
    module = Attention(LlamaConfig(vocab_size=8, dim=heads * dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads))
    apply_context_parallel(module, slices)
    g = torch.Generator().manual_seed(length + slices.rank)
    q = torch.randn(1, heads, length, dim, generator=g)
    k, v = (torch.randn(1, kv_heads, length, dim, generator=g) for _ in range(2))
    upstream = torch.randn(q.shape, generator=g)
    walls = []
    for repeat in range(settings["warmup"] + settings["repeats"]):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        dist.barrier()  # every rank starts together
        started = time.perf_counter()
        module.core_attention(*leaves).backward(upstream)
        if repeat >= settings["warmup"]:
            walls.append(time.perf_counter() - started)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    inputs = sum(t.untyped_storage().nbytes() for t in (*leaves, upstream))
    dist.barrier()
    with LiveTensorBytes(inputs) as counter:
        module.core_attention(*leaves).backward(upstream)
    return {"wall_s": statistics.median(walls), "peak_bytes": counter.peak}


def _worker(rank: int, world: int, store: str, out_dir: str, settings: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.pop("DISTTRAIN_STRICT_P2P", None)
    torch.set_num_threads(1)
    timeout = timedelta(seconds=settings["timeout_s"])
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timeout)
    groups = {}
    if world >= 4:  # hybrid: all-to-all over consecutive pairs, rings over the ranks with the same pair index
        pairs = [list(range(s, s + 2)) for s in range(0, world, 2)]
        groups["u"] = [dist.new_group(p) for p in pairs][rank // 2]
        groups["r"] = [dist.new_group(list(range(i, world, 2))) for i in range(2)][rank % 2]
    rows = []
    for length in settings["positions"]:
        row = {"positions_per_rank": length}
        for mode in settings["modes"]:
            row[mode] = _measure(mode, _slices(mode, world, length * world, groups), settings, length)
        rows.append(row)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def measure(settings: dict) -> list[dict]:
    """Per length: each mode's busiest-rank time and largest peak, and both as ratios to the ring's."""
    cp = settings["cp"]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker, args=(cp, os.path.join(tmp, "store"), tmp, settings), nprocs=cp, join=True, start_method="spawn"
        )
        ranks = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(cp)]
    out = []
    for index, length in enumerate(settings["positions"]):
        row = {"positions_per_rank": length, "cp": cp, "modes": {}}
        for mode in settings["modes"]:
            wall = max(r[index][mode]["wall_s"] for r in ranks)
            peak = max(r[index][mode]["peak_bytes"] for r in ranks)
            row["modes"][mode] = {"busiest_rank_s": wall, "peak_bytes": peak}
        ring = row["modes"].get("ring")
        for values in row["modes"].values():
            if ring:
                values["time_vs_ring"] = values["busiest_rank_s"] / ring["busiest_rank_s"]
                values["peak_vs_ring"] = values["peak_bytes"] / ring["peak_bytes"]
        out.append(row)
    return out


def main(argv: list[str]) -> int:
    from disttrain_core.validation import ConfigError

    options = tool_options(argv, OPTIONS)
    settings = {key: int(options[key]) for key in ("cp", "heads", "kv_heads", "head_dim", "repeats", "warmup")}
    settings.update(timeout_s=int(options["timeout_s"]), positions=[int(x) for x in options["positions"].split(",")])
    settings["modes"] = options["modes"].split(",")
    if "hybrid" in settings["modes"] and (settings["cp"] < 4 or settings["cp"] % 2):
        raise ConfigError(
            f"modes=...hybrid needs cp of 4 or more, even (2 ranks per all-to-all); got cp={settings['cp']}"
        )
    rows = measure(settings)
    report = {"machine": {"torch": torch.__version__, "device": "cpu", "cores": os.cpu_count()}, "settings": settings}
    report["rows"] = rows
    if options["out"] != "none":
        with open(options["out"], "w") as f:
            json.dump(report, f, indent=1)
    if options["format"] == "json":
        print(json.dumps(report, indent=1))
        return 0
    for row in rows:
        for mode, values in row["modes"].items():
            ratios = f" ({values['time_vs_ring']:.2f}x time, {values['peak_vs_ring']:.2f}x peak of the ring)" * (
                "time_vs_ring" in values
            )
            print(
                f"{row['positions_per_rank']:>6} positions/rank cp={row['cp']} {mode:9s}: busiest rank "
                f"{values['busiest_rank_s']:.3f} s, peak {values['peak_bytes'] / 2**20:.1f} MiB{ratios}"
            )
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(tool_main(main, sys.argv[1:]))
