"""The CPU a ring collective costs a process, without any computation beside it (issue 19).

On two cores the CPU a collective takes (the kernel's TCP work, gloo's threads, the ring thread) is taken
from the training thread: it cannot be hidden by overlap. This measures it the way bench_overlap's runs use
it: ``RingCollectives`` (comm/ring.py) on a 2-rank group, one reduce-scatter and one all-gather of a flat
buffer of ``bucket_mb`` (the size of one of bench_overlap's buckets), in place as ZeRO-1 runs them (this
rank's shard is its slice of the buffer), ``reps`` times each after a warm-up.
A rank's CPU time per collective is its process's user + system time over the collective (getrusage),
median over the repetitions; the wall time beside it.

    sudo python tools/netem_cluster.py nodes=2 rate=1gbit -- python tools/ring_cost.py   # emulated nodes
    python tools/ring_cost.py                                                             # loopback

Under netem_cluster each node's process is one rank (NODE_RANK, MASTER_ADDR, MASTER_PORT); without it
the tool starts both ranks over 127.0.0.1. Rank 0 prints one JSON line:
``{"bucket_mb", "reps", "reduce_scatter": {...}, "all_gather": {...}}`` with ``wall_ms``, ``cpu_ms``,
``user_ms``, ``sys_ms`` and ``voluntary_switches`` per collective. Options: ``bucket_mb`` (2), ``reps`` (100).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disttrain_core.launch.cli import split_tool_args

OPTIONS = {"bucket_mb": "2", "reps": "100"}  # at 20 the median moved by up to 60% between runs


def _sample() -> tuple[float, float, float, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), usage.ru_utime, usage.ru_stime, usage.ru_nvcsw


def measure(rank: int, options: dict) -> dict | None:
    import torch
    import torch.distributed as dist

    from disttrain_core.comm.ring import RingCollectives

    torch.set_num_threads(1)
    address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        ring = RingCollectives(dist.new_group([0, 1]))
        numel = int(float(options["bucket_mb"]) * 2**20) // 4
        # In place, as ZeRO-1's buckets are: this rank's shard is its slice of the flat bucket.
        flat = torch.randn(numel)
        shard = flat[rank * (numel // 2) : (rank + 1) * (numel // 2)]
        jobs = {
            "reduce_scatter": lambda: ring.reduce_scatter(shard, flat, async_op=False),
            "all_gather": lambda: ring.all_gather(flat, shard, async_op=False),
        }
        result: dict = {"bucket_mb": float(options["bucket_mb"]), "reps": int(options["reps"])}
        for name, job in jobs.items():
            for _ in range(3):
                job()
            rows = []
            for _ in range(int(options["reps"])):
                dist.barrier()
                before = _sample()
                job()
                after = _sample()
                rows.append([b - a for a, b in zip(before, after, strict=True)])
            wall, user, system, switches = (statistics.median(column) for column in zip(*rows, strict=True))
            cpu = statistics.median(r[1] + r[2] for r in rows)
            result[name] = {
                "wall_ms": 1e3 * wall,
                "cpu_ms": 1e3 * cpu,
                "user_ms": 1e3 * user,
                "sys_ms": 1e3 * system,
                "voluntary_switches": switches,
            }
        ring.close()
        return result if rank == 0 else None
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    options, _ = split_tool_args(argv, OPTIONS)
    if "NODE_RANK" in os.environ:  # one rank per emulated node
        result = measure(int(os.environ["NODE_RANK"]), options)
    elif "DISTTRAIN_RING_COST_RANK" in os.environ:  # a rank started below
        result = measure(int(os.environ["DISTTRAIN_RING_COST_RANK"]), options)
    else:  # loopback: start both ranks here
        from disttrain_core.base.net import free_port

        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        peer = subprocess.Popen(
            [sys.executable, __file__, *argv], env={**env, "DISTTRAIN_RING_COST_RANK": "1"}, stdout=subprocess.DEVNULL
        )
        os.environ.update(env)
        result = measure(0, options)
        if peer.wait(timeout=120) != 0:
            raise SystemExit("ring_cost: rank 1 failed")
    if result is not None:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
