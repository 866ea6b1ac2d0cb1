"""Peak FLOP/s (for MFU) and peak memory.

On CPUs there is no datasheet number that means anything for PyTorch, so the
peak is *measured*: the best of square matmuls (up to 2048, while one takes under 2 s) in the training
dtype, with the thread count the rank actually uses. The result is cached in
``~/.cache/disttrain/peak_flops.json`` keyed by CPU model, threads, dtype and
torch version. On GPUs the cluster preset's datasheet value is used when set.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from pathlib import Path

import torch

CACHE = Path(os.environ.get("DISTTRAIN_CACHE", Path.home() / ".cache" / "disttrain")) / "peak_flops.json"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown-cpu"


def measure_matmul_peak(
    dtype: torch.dtype, device: torch.device, size: int = 2048, repeats: int = 6, budget_s: float = 2.0
) -> float:
    """Best observed FLOP/s of square matmuls, up to ``size``.

    The size doubles from 256 while the next one is expected to take under ``budget_s`` per matmul, and
    repeats stop once ``budget_s`` is spent: a CPU without native bf16 (0.7 GFLOP/s at 1024 measured on
    one) would otherwise spend minutes on 2048-square bf16 matmuls before training starts.
    """
    n, peak = 256, 0.0
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        torch.matmul(a, b)  # warm-up (allocations, kernel selection)
        best, spent = float("inf"), 0.0
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            torch.matmul(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            best, spent = min(best, seconds), spent + seconds
            if spent > budget_s:
                break
        peak = max(peak, 2.0 * n**3 / best)
        if n >= size or 8 * best > budget_s:  # the next size costs about 8x
            return peak
        n *= 2


def _measured(dtype: torch.dtype, device: torch.device) -> float:
    """``measure_matmul_peak``, cached by device model, threads, dtype and torch version."""
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model()
    key = f"{device_name}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}"
    try:
        cache = json.loads(CACHE.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = measure_matmul_peak(dtype, device)
        try:
            CACHE.parent.mkdir(parents=True, exist_ok=True)
            tmp = CACHE.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            os.replace(tmp, CACHE)
        except OSError:
            pass  # a read-only home only costs a re-measurement next time
    return float(cache[key])


def peak_flops_per_device(
    precision: str, device: torch.device, cluster_bf16: float | None, cluster_fp32: float | None
) -> float:
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    configured = cluster_bf16 if dtype == torch.bfloat16 else cluster_fp32
    if configured:
        return float(configured)
    peak = _measured(dtype, device)
    if dtype == torch.bfloat16 and device.type == "cpu":
        # A CPU without native bf16 emulates bf16 matmuls slowly, while autocast's kernels for other
        # shapes may compute in fp32: the peak for bf16-mixed work is the faster of the two (measured:
        # 2.5 GFLOP/s bf16 against 79 fp32 on one core of an EPYC without AVX512-BF16).
        peak = max(peak, _measured(torch.float32, device))
    return peak


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory (CUDA) or peak resident set size (CPU), GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
