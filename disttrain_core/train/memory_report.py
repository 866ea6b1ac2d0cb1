"""What a rank really holds, beside what the memory model (planner/breakdown.py) predicts for its role.

``trainer.memory_report_step=N`` makes every rank write ``<run>/memory/rank<R>.json`` with:

* ``measured.state``: model-state bytes after the last optimizer step (before gradients are zeroed),
  counted from the *unique* storages behind parameters (frozen ones too), gradients, fp32 masters,
  optimizer state and communication buffers -- a view (ZeRO-1's parameters into its flat buffers, a
  DTensor's local shard) is counted once, with its storage's padding;
* ``measured.peak``: the live tensor bytes at the fullest moment of step N: the storages live when the
  step starts plus the largest running sum of the CPU/CUDA allocator's allocation and free events
  during the step (``torch.profiler`` with ``profile_memory``: an allocator-hook counter, so temporaries
  inside kernels are seen too), and for scale the process's resident set size (RSS) now and its
  high-water mark;
* ``predicted`` (added by launch/entry.py after training): the role's breakdown from the planner's model
  (planner/breakdown.py ``RoleMemory.as_dict``).
"""

from __future__ import annotations

import json
import resource
from contextlib import contextmanager
from pathlib import Path

import torch

CATEGORIES = ("params", "grads", "master", "moments", "buffers")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def state_tensors(engine, optimizer) -> dict[str, list[torch.Tensor]]:
    """The tensors behind each model-state category of an engine and its optimizer."""
    modules = list(engine.stages.values()) if hasattr(engine, "stages") else [engine.raw_model]
    params = [p for module in modules for p in module.parameters()]
    out: dict[str, list[torch.Tensor]] = {key: [] for key in CATEGORIES}
    out["params"] = [_local(p) for p in params]
    out["grads"] = [_local(p.grad) for p in params if p.grad is not None]
    inner = getattr(optimizer, "inner", optimizer)
    masters = list(optimizer.master_params()) if hasattr(optimizer, "flats") else []
    out["master"] = [m.detach() for m in masters]
    for state in inner.state.values():
        out["moments"] += [_local(v) for v in state.values() if torch.is_tensor(v) and v.numel() > 1]
    sync = getattr(optimizer, "sync", None)
    if sync is not None and hasattr(sync, "param_flat"):  # ZeRO-1: the gather buffers (views: counted once)
        out["buffers"] = list(sync.param_flat.values()) + list(sync.grad_flat.values())
        out["grads"] += [m.grad for m in masters if m.grad is not None]
    return out


def count_storages(groups: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes per category, each storage counted once (in the first category that references it)."""
    seen: set[int] = set()
    counted = {}
    for key in CATEGORIES:
        total = 0
        for tensor in groups.get(key, []):
            storage = tensor.untyped_storage()
            ident = storage._cdata  # the storage itself (data pointers are all 0 on the meta device)
            if ident in seen or storage.nbytes() == 0:
                continue
            seen.add(ident)
            total += storage.nbytes()
        counted[key] = total
    counted["total"] = sum(counted[key] for key in CATEGORIES)
    return counted


def rss_bytes() -> int:
    """The process's resident set size now (Linux /proc), or its peak where /proc is missing. glibc first
    returns the free heap pages it keeps (``malloc_trim``), so the number is what the process holds, not
    what the C allocator cached from earlier steps' freed tensors."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        import os

        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def running_peak(events, device_type: str) -> tuple[int, int]:
    """(largest running sum, final sum) of allocator events ``(start_ns, nbytes, device type name)`` of one
    device type: the training device's allocator only (host allocations on a GPU run are another memory)."""
    running = peak = 0
    for _, delta, kind in sorted(events):
        if kind == device_type:
            running += delta
            peak = max(peak, running)
    return peak, running


@contextmanager
def allocation_peak(result: dict, device: torch.device | None = None):
    """Record the largest running sum of ``device``'s allocator events inside the block into
    ``result['peak_delta']`` (default: the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    kind = (device or torch.device("cpu")).type
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kind == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        yield
    events = [
        (event.start_ns(), event.nbytes(), str(event.device_type()).split(".")[-1].lower())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]"
    ]
    result["peak_delta"], result["end_delta"] = running_peak(events, kind)


class MemoryReport:
    """Counts and measures this rank; ``launch/entry.py`` adds the planner's prediction for its role afterwards
    (planner/api.py ``annotate_memory_report``: the planner sits above train/)."""

    def __init__(self, cfg, run_dir: Path, rank: int, unit, pp_rank: int):
        self.path = Path(run_dir) / "memory" / f"rank{rank:05d}.json"
        self.step = int(cfg.trainer.memory_report_step)
        self.role = {"unit": unit.name, "pp": pp_rank, "shard": unit.shard, "recompute": unit.recompute}
        self.measured: dict = {}

    def start_of_step(self, engine, optimizer) -> None:
        self.measured["live_at_start"] = count_storages(state_tensors(engine, optimizer))["total"]

    def after_optimizer_step(self, engine, optimizer) -> None:
        self.measured["state"] = count_storages(state_tensors(engine, optimizer))

    def write(self, peak: dict) -> None:
        self.measured["peak"] = self.measured.get("live_at_start", 0) + peak.get("peak_delta", 0)
        self.measured["rss"] = rss_bytes()
        # The high-water mark of the resident set (Linux reports KiB): what the process needed at its fullest.
        self.measured["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"step": self.step, "role": self.role, "measured": self.measured}, indent=1))
