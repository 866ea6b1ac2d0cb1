"""Context parallelism (parallel/context_parallel.py, comm/ring_attention.py): memory, balance, time.

For each length in ``lengths`` and CP size in ``cps``, cp spawned processes (gloo, one thread each) measure:

* attention: forward + backward of one attention core on this rank's [1, heads, S / cp, head_dim] fp32
  queries: ``ring_attention`` for cp > 1 (each of ``layouts``), causal SDPA for cp = 1. Per rank, medians
  after ``warmup``: wall time, the CPU time of the rank's thread (its own computation: a rank blocked on a
  transfer uses none), the wall time blocked in ring_attention's waits and the CPU time of its block
  computations by kind (these processes wrap ``block_forward`` and ``block_backward`` where comm/ring_documents.py
  calls them, and ``_wait``; the modules themselves are unchanged).
* activations: bytes of the distinct non-parameter tensors autograd saves in the forward and loss of a
  small Llama (MEMORY_MODEL) through ``apply_context_parallel``, over those of one process.

This machine has 2 cores: cp = 4 runs 4 processes on 2 cores, so its wall times include time spent
descheduled and prove no speedup. CPU times are not inflated that way; the memory ratios and the balance
are the numbers that carry over to one device per rank.

Balance: score entries per rank from ``planned_blocks`` (a pure mirror of ``_Plan``) for ``balance_cps``,
checked against the real ``WorkCounter`` of every measured ring. Timeline (PNG at ``picture``, or none):
one cp = ``timeline_cp`` forward at the largest length, *simulated* from block CPU times measured on one
thread here and K/V transfers of ``latency_us`` + bytes / ``bandwidth_gbps`` (Gbit/s) (tools/bench_cp_timeline.py).

    python tools/bench_cp.py                                   # about 2 minutes here
    python tools/bench_cp.py lengths=512,1024 cps=1,2 picture=none format=json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from disttrain_core.comm import ring_attention as ring_module
from disttrain_core.comm import ring_documents  # where the ring's blocks call the kernels
from disttrain_core.comm.ring import Ring
from disttrain_core.config import REPO_ROOT, LlamaConfig
from disttrain_core.launch.cli import split_tool_args, tool_main
from disttrain_core.models.common import init_weights
from disttrain_core.models.llama import Llama
from disttrain_core.parallel.context_parallel import SequenceSlices, apply_context_parallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cp_timeline import planned_blocks, timeline_section  # noqa: E402

OPTIONS = {
    "lengths": "1024,2048,4096",
    "cps": "1,2,4",
    "layouts": "zigzag,contiguous",  # measured for cp > 1
    "balance_cps": "2,4,8",  # pure block counts (no processes)
    "heads": "8",
    "kv_heads": "2",
    "head_dim": "64",
    "repeats": "5",
    "warmup": "1",
    "timeout_s": "120",  # process-group timeout
    "timeline_cp": "4",
    "bandwidth_gbps": "1",
    "latency_us": "50",
    "format": "text",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_cp.json"),
    "picture": str(REPO_ROOT / "docs" / "results" / "bench_cp_timeline.png"),
}

# The Llama whose saved activations are counted: tests/distributed/test_context_parallel.py's, twice as wide.
MEMORY_MODEL = {"vocab_size": 96, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128}


def work_entries(layout: str, world: int, seq_len: int, heads: int = 1) -> list[int]:
    """Score entries per rank, counted as ``WorkCounter.add`` counts them (causal blocks: lower triangle)."""
    local_len = ring_module.padded_length(seq_len, world, layout) // world
    entries = []
    for rank in range(world):
        total = 0
        for block in planned_blocks(layout, world, rank, local_len):
            if block is not None:
                kind, rows, cols = block
                total += (rows * (rows + 1) // 2 if kind == "own" else rows * cols) * heads
        entries.append(total)
    return entries


def imbalance(values: list[float]) -> float:
    """Busiest rank over the mean: how much longer a step takes than with perfect balance."""
    return max(values) / statistics.mean(values)


class BlockTimer:
    """Wraps ring_attention's block kernels and waits (in the benchmark's processes only) to split a rank's
    time into its own block work (CPU time, by kind) and time blocked on transfers."""

    def __init__(self) -> None:
        self.local_len = 0
        self.reset()
        # block_forward(q, k, v, causal, ...), block_backward(grad_out, q, k, v, out, lse, causal, ...)
        ring_documents.block_forward = self._timed(ring_documents.block_forward, "forward", 0, 3)
        ring_documents.block_backward = self._timed(ring_documents.block_backward, "backward", 1, 6)
        original_wait = ring_module._wait

        def wait(works: list) -> None:
            started = time.perf_counter()
            original_wait(works)
            self.wait_s += time.perf_counter() - started

        ring_module._wait = wait

    def reset(self) -> None:
        self.wait_s = 0.0
        self.cpu: dict[str, list[float]] = {}  # "forward own" -> CPU seconds of each such block

    def _timed(self, function, phase: str, first: int, causal_at: int):
        def timed(*args):
            q, k, causal = args[first], args[first + 1], args[causal_at]
            kind = "own" if causal else "tail" if q.shape[-2] < self.local_len else "head"
            kind = "full" if kind == "head" and k.shape[-2] == self.local_len else kind
            started = time.thread_time()
            result = function(*args)
            self.cpu.setdefault(f"{phase} {kind}", []).append(time.thread_time() - started)
            return result

        return timed


def _time_attention(ring, length: int, layout: str, settings: dict, timer: BlockTimer) -> dict:
    """Medians over the repeats of one rank's forward + backward of the attention core."""
    heads, kv_heads, dim = settings["heads"], settings["kv_heads"], settings["head_dim"]
    world = 1 if ring is None else ring.size
    local = ring_module.padded_length(length, world, "zigzag" if ring is None else layout) // world
    g = torch.Generator().manual_seed(length + world)
    q = torch.randn(1, heads, local, dim, generator=g, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, local, dim, generator=g, requires_grad=True) for _ in range(2))
    upstream = torch.randn(1, heads, local, dim, generator=g)
    timer.local_len = local
    counter, samples = ring_module.WorkCounter(), []
    for repeat in range(settings["warmup"] + settings["repeats"]):
        q.grad = k.grad = v.grad = None
        if ring is not None:
            dist.barrier()  # every rank starts the ring together
        timer.reset()
        wall, cpu = time.perf_counter(), time.thread_time()
        if ring is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
        else:
            out = ring_module.ring_attention(q, k, v, ring, layout, counter if repeat == 0 else None)
        out.backward(upstream)
        sample = {
            "wall_s": time.perf_counter() - wall,
            "cpu_s": time.thread_time() - cpu,
            "wait_s": timer.wait_s,
            "block_cpu_s": sum(sum(times) for times in timer.cpu.values()),
        }
        sample.update({f"{key} block_cpu_s": statistics.mean(times) for key, times in timer.cpu.items()})
        if repeat >= settings["warmup"]:
            samples.append(sample)
    medians = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
    return {"local_len": local, "counted_entries": counter.entries, **medians}


def _saved_activation_bytes(length: int, slices=None) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in the small Llama's forward and loss
    (with ``slices``: context-parallel, this rank's positions)."""
    model = Llama(LlamaConfig(**MEMORY_MODEL, rope_theta=1e4), length)
    init_weights(model, seed=3, std=0.05)
    if slices is not None:
        apply_context_parallel(model, slices)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, MEMORY_MODEL["vocab_size"], (1, length), generator=torch.Generator().manual_seed(0))
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h, labels = model.embed(tokens), tokens
        if slices is not None:
            h, labels = slices.slice(h), slices.slice(labels, fill=-100)
        logits = model.logits(model.final_norm(model.run_layers(h)))
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    return sum(seen.values())


def _worker(rank: int, world: int, store: str, out_dir: str, settings: dict) -> None:
    """One rank of a cp = ``world`` run: its attention times and saved bytes at every length, as JSON."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    ring = None
    if world > 1:
        timeout = timedelta(seconds=settings["timeout_s"])
        dist.init_process_group(
            "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timeout
        )
        ring = Ring(dist.group.WORLD)
    timer = BlockTimer()
    result: dict = {"attention": [], "memory": []}
    for length in settings["lengths"]:
        for layout in settings["layouts"] if ring is not None else ["sdpa"]:
            row = {"length": length, "layout": layout, **_time_attention(ring, length, layout, settings, timer)}
            result["attention"].append(row)
            if rank == 0 and settings["verbose"]:
                print(f"  cp={world} S={length} {layout}: rank 0 CPU {row['cpu_s']:.3f} s", flush=True)
        memory = {"length": length}
        if ring is None or rank == 0:  # the reference: the whole sequence on one process
            memory["cp1_bytes"] = _saved_activation_bytes(length)
        if ring is not None:
            memory["bytes"] = _saved_activation_bytes(length, SequenceSlices(dist.group.WORLD, length))
        result["memory"].append(memory)
    if ring is not None:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


def run_cp(world: int, settings: dict, tmp: Path) -> list[dict]:
    """Spawn ``world`` ranks and return each rank's measurements."""
    out_dir = tmp / f"cp{world}"
    out_dir.mkdir()
    mp.start_processes(
        _worker, args=(world, str(out_dir / "store"), str(out_dir), settings), nprocs=world, start_method="spawn"
    )
    return [json.loads((out_dir / f"{rank}.json").read_text()) for rank in range(world)]


def summarize(runs: dict[int, list[dict]], cores: int) -> tuple[list[dict], list[dict]]:
    """Attention rows (per-rank medians, CPU balance, CPU over cp = 1's) and memory rows (ratio to cp = 1)."""
    attention, memory = [], []
    cp1_cpu = {row["length"]: row["cpu_s"] for row in runs[1][0]["attention"]} if 1 in runs else {}
    for cp, ranks in runs.items():
        for i, row in enumerate(ranks[0]["attention"]):
            per_rank = [r["attention"][i] for r in ranks]
            cpu = [r["cpu_s"] for r in per_rank]
            entry = dict(cp=cp, length=row["length"], layout=row["layout"], processes_per_core=cp / cores)
            entry.update(cpu_max_s=max(cpu), cpu_balance=imbalance(cpu), wall_max_s=max(r["wall_s"] for r in per_rank))
            entry["wait_mean_s"] = statistics.mean(r["wait_s"] for r in per_rank)
            if row["length"] in cp1_cpu:  # the busiest rank, and all ranks together, against one SDPA process
                entry["cpu_max_over_cp1"] = max(cpu) / cp1_cpu[row["length"]]
                entry["cpu_sum_over_cp1"] = sum(cpu) / cp1_cpu[row["length"]]
            attention.append({**entry, "per_rank": per_rank})
        for i, row in enumerate(ranks[0]["memory"]):
            whole = row["cp1_bytes"]
            per_rank = [r["memory"][i].get("bytes", whole) for r in ranks]
            memory.append(dict(cp=cp, length=row["length"], bytes_per_rank=per_rank, cp1_bytes=whole))
            memory[-1]["ratio"] = max(per_rank) / whole
    return attention, memory


def balance_section(runs: dict[int, list[dict]], length: int, cps: list[int], heads: int) -> dict:
    """Counted work per rank (pure) for ``cps``, and the real counters of the spawned runs beside it."""
    section: dict = {"length": length, "heads": heads, "rows": [], "cross_check": []}
    for cp in cps:
        row: dict = {"cp": cp}
        for layout in ring_module.LAYOUTS:
            entries = work_entries(layout, cp, length, heads)
            row[layout] = {"entries_per_rank": entries, "max_over_mean": imbalance(entries)}
        section["rows"].append(row)
    for cp in (cp for cp in runs if cp > 1):  # the real WorkCounter of every measured ring, per rank
        for i, row in enumerate(runs[cp][0]["attention"]):
            counted = [r["attention"][i]["counted_entries"] for r in runs[cp]]
            planned = work_entries(row["layout"], cp, row["length"], heads)
            check = dict(cp=cp, length=row["length"], layout=row["layout"], counter=counted, pure=planned)
            section["cross_check"].append({**check, "equal": counted == planned})
    return section


def report(results: dict) -> None:
    """The text summary: memory, measured attention, counted balance, simulated timeline."""
    for row in results["memory"]:
        print(f"activations cp={row['cp']} S={row['length']}: {row['ratio']:.3f}x cp=1 per rank")
    for r in results["attention"]:
        vs = f" = {r['cpu_max_over_cp1']:.2f}x cp=1" if "cpu_max_over_cp1" in r else ""
        print(
            f"attention cp={r['cp']} S={r['length']} {r['layout']}: max CPU {r['cpu_max_s'] * 1e3:.1f} ms{vs}, "
            f"balance {r['cpu_balance']:.2f}, wall {r['wall_max_s'] * 1e3:.1f} ms, wait {r['wait_mean_s'] * 1e3:.0f} ms"
        )
    for row in results["balance"]["rows"]:
        work = {layout: round(row[layout]["max_over_mean"], 3) for layout in ring_module.LAYOUTS}
        print(f"counted work cp={row['cp']}: max/mean {work}")
    print(f"real counter = pure count: {all(c['equal'] for c in results['balance']['cross_check'])}")
    print(f"simulated forward (s): {results['timeline']['makespan_s']}")


def main(argv: list[str]) -> int:
    options, _ = split_tool_args(argv, OPTIONS)
    cps, lengths, balance_cps = ([int(x) for x in options[key].split(",")] for key in ("cps", "lengths", "balance_cps"))
    layouts = options["layouts"].split(",")
    if not set(layouts) <= set(ring_module.LAYOUTS):  # before any process starts
        raise SystemExit(f"error: layouts={options['layouts']}: allowed values are {', '.join(ring_module.LAYOUTS)}")
    cores = len(os.sched_getaffinity(0))
    settings = {key: int(options[key]) for key in ("heads", "kv_heads", "head_dim", "repeats", "warmup", "timeout_s")}
    settings.update(lengths=lengths, layouts=layouts, verbose=options["format"] != "json")
    runs, load_before = {}, os.getloadavg()  # the machine is shared: other work shows in the wall times
    with tempfile.TemporaryDirectory() as tmp:
        for cp in cps:
            if settings["verbose"]:
                print(f"cp={cp}: {cp} processes on {cores} cores", flush=True)
            runs[cp] = run_cp(cp, settings, Path(tmp))
    attention, memory = summarize(runs, cores)
    results = {
        "machine": {"cores": cores, "cpu_count": os.cpu_count(), "torch": torch.__version__, "threads_per_rank": 1},
        "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()},
        "note": (
            f"{cores} cores: a cp above {cores} runs more processes than cores (processes_per_core), so its wall "
            "times include time spent descheduled and are no evidence of speedup. cpu_s is a rank's own computation "
            "(thread CPU time), wait_s its time blocked on transfers; memory ratios and balance are the headline. "
            "The timeline is simulated."
        ),
        "options": options,
        "attention_shape": {key: settings[key] for key in ("heads", "kv_heads", "head_dim")} | {"batch": 1},
        "memory_model": MEMORY_MODEL,
        "attention": attention,
        "memory": memory,
        "balance": balance_section(runs, max(lengths), balance_cps, settings["heads"]),
        "timeline": timeline_section(options, settings, max(lengths)),
    }
    out = Path(options["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    if options["format"] == "json":
        print(json.dumps(results))
    else:
        report(results)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
