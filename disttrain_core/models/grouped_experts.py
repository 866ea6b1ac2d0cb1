"""The routed experts of a MoE layer in grouped matmuls (``moe.experts_kernel``), without host syncs.

The per-expert path (models/moe.py ``run_experts``) sorts the rows by expert, reads the block sizes back to the
host (a sync on CUDA) and runs three matmuls per expert in a Python loop. Here the rows are sorted on the device,
the block boundaries stay a device tensor (``offs``, the cumulative counts), and each of SwiGLU's three
projections runs as one ``torch._grouped_mm`` over all of the module's experts: the number of kernels no longer
grows with the experts, and nothing is read back. An expert with no rows gets a zero gradient, as in the loop.
Each expert's rows start at a multiple of 16 rows in a zero-padded buffer (``aligned_slots``; TorchTitan pads the
same way): CUDA's grouped matmul stops the process with a device-side assert when a group's extent is not a
multiple of 16 bytes, and the weight gradient splits the rows (an H200 hit it at the first uneven routing).

The experts keep their parameters (``experts.<e>.w1.weight`` ...: checkpoints, initialization and expert
parallelism are unchanged); each projection stacks them into one [E, out, in] operand in forward and again in
backward (``_GroupedLinear``), so the stacked copy is a temporary, never an activation kept for backward.

``torch._grouped_mm`` runs on CUDA devices of compute capability 9.0 and newer and, in torch 2.13, on the CPU;
``grouped_available`` tries it once per device. ``auto`` takes it on CUDA where it runs and keeps the loop on the
CPU, where it measured slower (``use_grouped``); ``grouped`` runs it wherever it runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..base.dtensor import local as local_part

KERNELS = ("auto", "grouped", "loop")


@functools.cache
def _works(device_type: str, index: int | None, dtype: torch.dtype) -> bool:
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    try:
        x = torch.ones(4, 16, device=device, dtype=dtype)
        w = torch.ones(2, 16, 8, device=device, dtype=dtype)
        offs = torch.tensor([2, 4], device=device, dtype=torch.int32)
        return torch._grouped_mm(x, w, offs=offs).shape == (4, 8)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def grouped_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs on ``device`` in ``dtype`` (tried once, then remembered)."""
    if device.type == "meta":
        return False
    return _works(device.type, device.index, dtype)


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matmul runs in: the autocast dtype where autocast is on for the device (grouped_mm is not on
    autocast's lists, so the cast is ours), else the input's."""
    kind = x.device.type
    if kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


class _GroupedLinear(torch.autograd.Function):
    """rows [N, in] sorted by group, ``offs`` [E] int32 cumulative row counts, weights E x [out, in] -> [N, out]:
    row block g times weights[g].T; the stacked weights are built again in backward, not saved."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype, *weights: torch.Tensor):
        stacked = torch.stack([w.to(dtype) for w in weights])  # [E, out, in]
        ctx.save_for_backward(rows, offs, *weights)
        ctx.dtype = dtype
        return torch._grouped_mm(rows.to(dtype), stacked.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, offs, *weights = ctx.saved_tensors
        dtype = ctx.dtype
        grad = grad.to(dtype).contiguous()
        stacked = torch.stack([w.to(dtype) for w in weights])  # [E, out, in]
        grad_rows = torch._grouped_mm(grad, stacked, offs=offs).to(rows.dtype)
        # per group: grad_block.T @ rows_block, a grouped matmul over the shared (row) dimension, whose stride must
        # be a multiple of 16 bytes: the rows are run_experts_grouped's padded layout (padded_rows, a multiple of
        # ALIGN_ROWS rows, every group starting aligned), so grad.T's row stride already is
        grad_stacked = torch._grouped_mm(grad.t().contiguous(), rows.to(dtype).contiguous(), offs=offs)  # [E, out, in]
        grads = [g.to(w.dtype) for g, w in zip(grad_stacked.unbind(0), weights, strict=True)]
        return (grad_rows, None, None, *grads)


def run_experts_grouped(experts: nn.ModuleDict, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Row ``i`` of the result is ``experts[str(ids[i])](rows[i])`` (SwiGLU experts), in grouped matmuls; every id
    must be one of the module's experts, which ``use_grouped`` has checked are contiguous (the ids themselves are
    not checked: that would read them back)."""
    keys = sorted(int(key) for key in experts.keys())
    modules = [experts[str(key)] for key in keys]
    local = ids - keys[0]  # the module's experts are one contiguous range (expert_range): no lookup table
    order = torch.argsort(local, stable=True)
    slots, offs = aligned_slots(local.index_select(0, order), len(keys))
    # each expert's rows at a 16-row-aligned start, zero rows between (they add nothing to any weight gradient)
    sorted_rows = rows.index_select(0, order)
    padded = sorted_rows.new_zeros(padded_rows(rows.shape[0], len(keys)), rows.shape[1])
    padded = padded.index_copy(0, slots, sorted_rows)
    dtype = _matmul_dtype(rows)

    def project(x: torch.Tensor, name: str) -> torch.Tensor:
        return _GroupedLinear.apply(x, offs, dtype, *(local_part(getattr(m, name).weight) for m in modules))

    hidden = F.silu(project(padded, "w1")) * project(padded, "w3")
    outputs = project(hidden, "w2").index_select(0, slots)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return outputs.index_select(0, inverse)


# Rows per expert block are padded to a multiple of this: on CUDA, torch._grouped_mm needs every group's extent
# along a dimension the offsets split to be a multiple of 16 bytes (the weight gradient splits the rows: 8 rows in
# bf16), else a device-side assert stops the process (seen on an H200, 2026-12-04). 16 rows covers every dtype.
ALIGN_ROWS = 16


def padded_rows(n: int, experts: int) -> int:
    """Rows of the padded layout: a bound known on the host (no count is read back), a multiple of ALIGN_ROWS."""
    return -(-(n + experts * (ALIGN_ROWS - 1)) // ALIGN_ROWS) * ALIGN_ROWS


def aligned_slots(sorted_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows sorted by expert id (0..experts-1): each row's slot in the padded layout, where every expert's block
    starts at a multiple of ALIGN_ROWS, and the blocks' cumulative padded ends (int32, the grouped matmul's
    ``offs``). All on the device."""
    counts = torch.bincount(sorted_ids, minlength=experts)
    padded = (counts + ALIGN_ROWS - 1) // ALIGN_ROWS * ALIGN_ROWS
    ends = padded.cumsum(0)
    start_padded, start = ends - padded, counts.cumsum(0) - counts
    position = torch.arange(sorted_ids.numel(), device=sorted_ids.device)
    slots = start_padded.index_select(0, sorted_ids) + position - start.index_select(0, sorted_ids)
    return slots, ends.to(torch.int32)


def use_grouped(kernel: str, experts: nn.ModuleDict, rows: torch.Tensor) -> bool:
    """``moe.experts_kernel``: auto takes the grouped matmuls on a CUDA device that runs them when the shapes suit
    them (contiguous expert ids; rows of a multiple of 16 bytes, grouped_mm's alignment), grouped insists on any
    device (ValueError naming why not), loop never. Not auto on the CPU: torch 2.13's CPU grouped_mm is no faster
    than the loop there, and the stacked weights cost copies (tools/bench_kernels.py: 1.21-1.27x the loop's time)."""
    if kernel == "loop" or (kernel == "auto" and rows.device.type != "cuda"):
        return False
    keys = sorted(int(key) for key in experts.keys())
    dtype = _matmul_dtype(rows)
    first = experts[str(keys[0])]
    weight = local_part(first.w1.weight)  # under tensor parallelism: this rank's hidden slice
    widths = (weight.shape[1], weight.shape[0])  # dim, hidden
    reason = None
    if keys != list(range(keys[0], keys[0] + len(keys))):
        reason = f"the experts {keys} are not a contiguous range"
    elif any(width * torch.empty((), dtype=dtype).element_size() % 16 for width in widths):
        reason = f"the widths {widths} in {dtype} are not multiples of 16 bytes"
    elif not grouped_available(rows.device, dtype):
        reason = f"torch._grouped_mm does not run on {rows.device} in {dtype} (CUDA needs compute capability 9.0+)"
    if reason is not None and kernel == "grouped":
        raise ValueError(f"moe.experts_kernel=grouped: {reason}; use moe.experts_kernel=auto or loop")
    return reason is None
