"""Every torch API that moved between the releases this project runs on (torch 2.11 through 2.13), and every
private one it relies on, in one place: the rest of the code imports them from here.

* renamed: torch 2.13 names the flat collectives ``reduce_scatter_single`` / ``all_gather_single`` (the old
  ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` warn there); 2.11 and 2.12 have only the old names;
* private: the attention kernels that return their log-sum-exp (ring attention merges blocks with it), the
  dispatch-mode base class (host-sync checker, tensor counters), DTensor's shard geometry, pipelining's split
  backward, autograd's graph-task id, the fake process group of the meta-device rehearsal, NCCL's flight
  recorder dump.

:func:`api_report` resolves each of them on the installed torch (``tools/gpu_check.py`` prints it first).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (re-exported: the modes' base class)

SUPPORTED = ("2.11", "2.12", "2.13")  # pyproject.toml's range: torch>=2.11,<2.14


def torch_release(version: str | None = None) -> str:
    """``major.minor`` of ``version`` (default: the installed torch)."""
    return ".".join((version or torch.__version__).split("+")[0].split(".")[:2])


# ------------------------------------------------------------------ renamed collectives
def reduce_scatter_tensor(output: torch.Tensor, source: torch.Tensor, group=None, async_op: bool = False):
    """``output`` = this rank's slice of the sum over the group of ``source`` (flat, equal slices)."""
    op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return op(output, source, group=group, async_op=async_op)


def all_gather_tensor(output: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False):
    """``output`` = every rank's ``shard`` end to end, in group-rank order."""
    op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return op(output, shard, group=group, async_op=async_op)


# ------------------------------------------------------------------ private APIs
def _attribute(module: str, name: str) -> Callable[[], object]:
    return lambda: getattr(importlib.import_module(module), name)


def _aten(name: str) -> Callable[[], object]:
    return lambda: getattr(torch.ops.aten, name).default


def local_shape_and_offset(global_shape, mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's (local shape, global offset) of a DTensor of ``global_shape`` placed on ``mesh``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(global_shape, mesh, placements)


def split_backward():
    """(stage_backward_input, stage_backward_weight): pipelining's backward split into dX and dW (ZB schedules)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    return stage_backward_input, stage_backward_weight


def current_graph_task_id() -> int:
    """Autograd's id of the backward running on this thread (-1 outside backward: a first forward)."""
    return torch._C._current_graph_task_id()


def fake_store():
    """The store of the fake process group (the meta-device rehearsal's ``fake`` backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore


def dump_flight_trace(**options) -> bytes:
    """NCCL's own flight recorder of this process, as the bytes torch serializes it to."""
    from torch._C._distributed_c10d import _dump_fr_trace

    return _dump_fr_trace(**options)


# name -> resolver; resolving raises where the installed torch lacks it
PRIVATE = {
    "aten._scaled_dot_product_flash_attention_for_cpu": _aten("_scaled_dot_product_flash_attention_for_cpu"),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": _aten(
        "_scaled_dot_product_flash_attention_for_cpu_backward"
    ),
    "aten._scaled_dot_product_flash_attention": _aten("_scaled_dot_product_flash_attention"),
    "aten._scaled_dot_product_flash_attention_backward": _aten("_scaled_dot_product_flash_attention_backward"),
    "aten._scaled_dot_product_efficient_attention": _aten("_scaled_dot_product_efficient_attention"),
    "aten._scaled_dot_product_efficient_attention_backward": _aten("_scaled_dot_product_efficient_attention_backward"),
    "TorchDispatchMode": _attribute("torch.utils._python_dispatch", "TorchDispatchMode"),
    "DTensor local shape and offset": _attribute(
        "torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"
    ),
    "pipelining split backward": split_backward,
    "autograd graph task id": lambda: torch._C._current_graph_task_id,
    "fake process group store": fake_store,
    "pytree register_dataclass": _attribute("torch.utils._pytree", "register_dataclass"),
    "sharded tensor (DCP of ZeRO-1 chunks)": _attribute("torch.distributed._shard.sharded_tensor", "ShardedTensor"),
    "flight recorder dump": _attribute("torch._C._distributed_c10d", "_dump_fr_trace"),
}
PUBLIC = {
    "reduce-scatter (reduce_scatter_single | reduce_scatter_tensor)": lambda: (
        getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ),
    "all-gather (all_gather_single | all_gather_into_tensor)": lambda: (
        getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ),
    "FSDP2 fully_shard": _attribute("torch.distributed.fsdp", "fully_shard"),
    "DTensor loss_parallel": _attribute("torch.distributed.tensor.parallel", "loss_parallel"),
    "DCP async_save": _attribute("torch.distributed.checkpoint", "async_save"),
    "get_total_norm": _attribute("torch.nn.utils", "get_total_norm"),
    "FlexAttention": _attribute("torch.nn.attention.flex_attention", "flex_attention"),
}


def api_report() -> dict[str, str]:
    """Each API this project uses that can differ between torch releases: ``ok`` or why not."""
    out = {}
    for name, resolve in {**PUBLIC, **PRIVATE}.items():
        try:
            resolve()
            out[name] = "ok"
        except Exception as error:  # an AttributeError or ImportError names what is missing
            out[name] = f"missing: {type(error).__name__}: {error}"
    return out
