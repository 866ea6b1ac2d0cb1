"""Peak FLOP/s (for MFU) and peak memory.

On CPUs there is no datasheet number that means anything for PyTorch, so the
peak is *measured*: the best of square matmuls (up to 2048, while one takes under 2 s) in the training
dtype, with the thread count the rank actually uses. The result is cached in
``~/.cache/disttrain/peak_flops.json`` keyed by CPU model, threads, dtype and
torch version.

On GPUs MFU is against the datasheet's dense peak of the math the step runs: bf16 under bf16-mixed, TF32
for fp32 with ``trainer.tf32`` on (the default: fp32 matmuls then run on tensor cores, 7x the plain fp32
peak of an H100, against which MFU could pass 100%), plain fp32 otherwise. The cluster preset's
``peak_flops_*`` when set, else the card's own row below (a GPU run with the default ``cluster=local_cpu``);
a card not listed falls back to a measured matmul peak, said in one line before launch
(:func:`peak_source`), with the setting that fixes it.
"""

from __future__ import annotations

import platform
import resource
import time
from pathlib import Path

import torch

from ..base.disk_cache import cache_root, read_json, write_json

CACHE = cache_root(measured=True) / "peak_flops.json"


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
    cache = read_json(CACHE) or {}
    if key not in cache:
        cache[key] = measure_matmul_peak(dtype, device)
        write_json(CACHE, cache, indent=1)  # a read-only home only costs a re-measurement next time
    return float(cache[key])


# Dense peak FLOP/s (no sparsity) from the vendors' datasheets: (bf16, tf32, fp32). Matched in order on the
# name torch reports ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", ...).
DATASHEET = (
    ("H100 PCIe", (756.5e12, 378.0e12, 51.2e12)),
    ("H100 NVL", (835.5e12, 417.5e12, 60.0e12)),
    ("H100", (989.4e12, 494.7e12, 66.9e12)),  # SXM5
    ("H200 NVL", (835.5e12, 417.5e12, 60.0e12)),
    ("H200", (989.4e12, 494.7e12, 66.9e12)),
    ("GH200", (989.4e12, 494.7e12, 66.9e12)),
    ("A100", (312.0e12, 156.0e12, 19.5e12)),
    ("A800", (312.0e12, 156.0e12, 19.5e12)),
)
MATH = ("bf16", "tf32", "fp32")


def step_math(precision: str, device_type: str, tf32: bool = True) -> str:
    """What the step's matmuls run in: bf16, tf32 (CUDA fp32 with TF32 allowed) or fp32."""
    if precision.startswith("bf16"):
        return "bf16"
    return "tf32" if device_type == "cuda" and tf32 else "fp32"


def datasheet_peak(device_name: str, math: str) -> float | None:
    for pattern, peaks in DATASHEET:
        if pattern in device_name:
            return peaks[MATH.index(math)]
    return None


def peak_source(math: str, device_name: str, cluster) -> str | None:
    """None when MFU has a datasheet peak for ``device_name`` (preset or table), else the one line saying
    that MFU falls back to a measured matmul peak and how to set one."""
    configured = {"bf16": cluster.peak_flops_bf16, "tf32": getattr(cluster, "peak_flops_tf32", None)}
    configured["fp32"] = cluster.peak_flops_fp32
    if configured[math] or datasheet_peak(device_name, math):
        return None
    return (
        f"MFU: no datasheet peak for {device_name!r} ({math}); MFU is reported against a matmul peak measured at "
        f"start, below the datasheet's: set cluster.peak_flops_{math}=<dense FLOP/s of the card> "
        "(e.g. cluster.peak_flops_bf16=989e12 for an H100 SXM)"
    )


def cpu_bf16_line(precision: str) -> str | None:
    """On a CPU whose oneDNN has no bf16 kernels (AVX2 only: no AVX512, no AMX), the one line saying that
    bf16-mixed runs its matmuls on torch's reference kernels, many times slower than fp32 (4.5-71x by operand
    layout, docs/performance/test_suite.md); None where bf16 has native kernels or is not used."""
    if not precision.startswith("bf16"):
        return None
    supported = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    if supported is None or supported():
        return None
    return (
        f"trainer.precision={precision} on a CPU without native bf16 (torch's CPU capability: "
        f"{torch.backends.cpu.get_cpu_capability()}): its matmuls run on reference kernels, many times slower "
        "than fp32; trainer.precision=32 trains faster on this machine"
    )


def peak_flops_per_device(
    precision: str,
    device: torch.device,
    cluster_bf16: float | None,
    cluster_fp32: float | None,
    cluster_tf32: float | None = None,
    tf32: bool = True,
) -> float:
    """Peak FLOP/s of one device for the step's math (see the module doc)."""
    math = step_math(precision, device.type, tf32)
    configured = {"bf16": cluster_bf16, "tf32": cluster_tf32, "fp32": cluster_fp32}[math]
    if configured:
        return float(configured)
    if device.type == "cuda":
        listed = datasheet_peak(torch.cuda.get_device_name(device), math)
        if listed:
            return listed
    dtype = torch.bfloat16 if math == "bf16" else torch.float32
    peak = _measured(dtype, device)
    if dtype == torch.bfloat16 and device.type == "cpu":
        # A CPU without native bf16 emulates bf16 matmuls slowly, while autocast's kernels for other
        # shapes may compute in fp32: the peak for bf16-mixed work is the faster of the two (measured:
        # 2.5 GFLOP/s bf16 against 79 fp32 on one core of an EPYC without AVX512-BF16).
        peak = max(peak, _measured(torch.float32, device))
    return peak


def peak_memory_gib(device: torch.device, reset: bool = True) -> float:
    """Peak allocated device memory since the last call (CUDA: the allocator's peak, then reset, so each
    logging window reports its own), or the peak resident set size since the process started (CPU: the
    kernel keeps only that), GiB."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
