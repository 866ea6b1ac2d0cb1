"""The ring-attention timeline of tools/bench_cp.py: one forward of cp ranks *simulated* from block CPU times
measured on one thread here and K/V transfers of latency + bytes / bandwidth, drawn as a PNG; and
``planned_blocks``, the blocks each rank computes per ring step (a mirror of ring_attention's ``_Plan``)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from disttrain_core.comm import ring_attention as ring_module
from disttrain_core.comm.attention_blocks import block_forward
from disttrain_core.config import REPO_ROOT

KIND_LABELS = {
    "own": "own block (causal)",
    "head": "my queries x its head chunk",
    "tail": "my tail chunk x its block",
    "full": "my queries x its block (contiguous)",
}


def planned_blocks(layout: str, world: int, rank: int, local_len: int) -> list[tuple[str, int, int] | None]:
    """(kind, query rows, key rows) of each ring step of ``rank``, None when masked: ``_Plan``, written out
    so the work of cp = 8 needs no processes (kept equal to it by the real counter's cross-check)."""
    half = local_len // 2
    blocks: list[tuple[str, int, int] | None] = [("own", local_len, local_len)]
    for step in range(1, world):
        owner = (rank - step) % world
        if layout == "contiguous":
            blocks.append(("full", local_len, local_len) if owner < rank else None)
        elif owner < rank:  # its head chunk precedes both of mine
            blocks.append(("head", local_len, half))
        else:  # only my tail chunk follows it
            blocks.append(("tail", local_len - half, local_len))
    return blocks


def block_cpu_times(length: int, world: int, settings: dict) -> dict[str, float]:
    """CPU seconds of one forward block of each kind at cp = ``world`` (its kernel; the merge into the fp32
    accumulator is a few elementwise passes over the output), on one thread here. The kinds take turns, as in
    a ring."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    heads, kv_heads, dim = settings["heads"], settings["kv_heads"], settings["head_dim"]
    local = ring_module.padded_length(length, world, "zigzag") // world
    shapes = {"own": (local, local, True), "head": (local, local // 2, False), "tail": (local // 2, local, False)}
    shapes["full"] = (local, local, False)
    samples: dict[str, list[float]] = {kind: [] for kind in shapes}
    for _ in range(settings["warmup"] + 2 + settings["repeats"]):
        for kind, (rows, cols, causal) in shapes.items():
            q = torch.randn(1, heads, rows, dim)
            k, v = (torch.randn(1, kv_heads, cols, dim) for _ in range(2))
            started = time.thread_time()
            block_forward(q, k, v, causal, None, dim**-0.5)
            samples[kind].append(time.thread_time() - started)
    torch.set_num_threads(threads)
    return {kind: statistics.median(times[-settings["repeats"] :]) for kind, times in samples.items()}


def simulate_forward(layout: str, world: int, block_s: dict[str, float], transfer_s: float) -> dict:
    """Events of one ring-attention forward: each step a rank computes its block while its K/V go to the
    next rank (a transfer starts once both ends have posted it); the next step starts when the block is
    done and both the send and the receive have completed (``_wait`` on both, as ring_attention does)."""
    plans = [planned_blocks(layout, world, rank, 2) for rank in range(world)]  # any size: only kinds matter
    start = [0.0] * world
    events: list[dict] = []
    for step in range(world):
        done = []
        for rank in range(world):
            block = plans[rank][step]
            end = start[rank] + (block_s[block[0]] if block else 0.0)
            if block:
                events.append({"rank": rank, "lane": "compute", "kind": block[0], "start": start[rank], "end": end})
            done.append(end)
        if step == world - 1:
            return {"events": events, "makespan_s": max(done)}
        # arrived[r]: the end of the transfer from rank r - 1 to r, posted once both have started this step
        arrived = [max(start[r - 1], start[r]) + transfer_s for r in range(world)]  # start[-1]: the last rank
        events += [
            {"rank": r, "lane": "transfer", "start": arrived[r] - transfer_s, "end": arrived[r]} for r in range(world)
        ]
        start = [max(done[r], arrived[r], arrived[(r + 1) % world]) for r in range(world)]  # received and sent
    raise AssertionError("unreachable")


def draw_timeline(panels: list[tuple[str, dict]], world: int, path: Path) -> Path:
    """Per layout, two lanes per rank (block computations by kind, incoming K/V transfer), in ms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"own": "#4c72b0", "head": "#55a868", "tail": "#dd8452", "full": "#8172b2", "transfer": "#999999"}
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.1 * world * len(panels) + 1.2), squeeze=False, sharex=True)
    for ax, (title, simulated) in zip(axes[:, 0], panels, strict=True):
        for event in simulated["events"]:
            row = 2 * (world - 1 - event["rank"]) + (1 if event["lane"] == "compute" else 0)
            color = colors[event.get("kind", "transfer")]
            width = 1000 * (event["end"] - event["start"])
            ax.barh(row, width, left=1000 * event["start"], height=0.75, color=color, edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(2 * world))
        ax.set_yticklabels([f"rank {r} {lane}" for r in reversed(range(world)) for lane in ("K/V in", "compute")])
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title(f"{title}: {1000 * simulated['makespan_s']:.1f} ms (SIMULATED)", fontsize=9)
    axes[-1, 0].set_xlabel("ms")
    labels = {**KIND_LABELS, "transfer": "K/V transfer from the previous rank"}
    handles = [Patch(color=c, label=labels[k]) for k, c in colors.items()]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline_section(options: dict, settings: dict, length: int) -> dict:
    """The simulated cp = ``timeline_cp`` forward of both layouts (and its picture unless ``picture=none``)."""
    world, latency = int(options["timeline_cp"]), float(options["latency_us"]) * 1e-6
    block_s = block_cpu_times(length, world, settings)
    local = ring_module.padded_length(length, world) // world
    kv_bits = 8 * 2 * settings["kv_heads"] * local * settings["head_dim"] * 4  # K and V, fp32
    transfer_s = latency + kv_bits / (float(options["bandwidth_gbps"]) * 1e9)
    simulated = {layout: simulate_forward(layout, world, block_s, transfer_s) for layout in ring_module.LAYOUTS}
    section = dict(simulated=True, cp=world, length=length, block_cpu_s=block_s, kv_bytes_per_step=kv_bits // 8)
    section.update(transfer_s=transfer_s, bandwidth_gbps=float(options["bandwidth_gbps"]), latency_us=latency * 1e6)
    section["makespan_s"] = {layout: s["makespan_s"] for layout, s in simulated.items()}
    section["exposed_transfer_s"] = {
        layout: s["makespan_s"] - simulate_forward(layout, world, block_s, 0.0)["makespan_s"]
        for layout, s in simulated.items()
    }
    # Above this bandwidth every zig-zag transfer ends before the block computed beside it (smallest: head/tail).
    section["hidden_above_gbps"] = kv_bits / 1e9 / max(min(block_s["head"], block_s["tail"]) - latency, 1e-9)
    if options["picture"] != "none":
        title = f"ring attention forward, cp={world}, S={length}, {options['bandwidth_gbps']} Gbit/s"
        panels = [(f"{title}, {layout}", simulated[layout]) for layout in ring_module.LAYOUTS]
        picture = draw_timeline(panels, world, Path(options["picture"]).resolve())
        section["picture"] = str(picture.relative_to(REPO_ROOT)) if picture.is_relative_to(REPO_ROOT) else str(picture)
    return section
