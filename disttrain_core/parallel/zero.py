"""ZeRO stage 1: AdamW whose states live on 1/dp of the data-parallel replicas each.

This rank's (local, possibly tensor-parallel) parameters are laid end to end in two
flat fp32 buffers -- weights that decay, and vectors that do not -- cut into buckets
(``parallel.comm.bucket_mb``), each bucket padded to a multiple of the unit's
data-parallel size and split in ``dp`` equal slices (comm/buckets.py). A step:

1. reduce-scatter (sum) the gradients bucket by bucket: replica ``r`` receives the
   summed gradient of its slice of every bucket -- during the last microbatch's
   backward when ``overlap_grad_reduce`` is on (comm/engine.py);
2. AdamW on the shard: the fp32 master copy of shard ``r`` and its two moments
   are all this replica stores -- 12 bytes per parameter spread over ``dp`` replicas
   instead of on each (the "1/dp" of optimizer state);
3. all-gather the updated slices and copy them back into the parameters -- during
   the next forward, module by module, when ``overlap_param_gather`` is on.

Memory (Megatron's distributed-optimizer layout, "lean"): the parameters and their
gradients are *views* into per-bucket flat fp32 buffers (comm/buckets.py ``bind``).
Gradients accumulate in place, the reduce-scatter lands in this replica's slice of the
gradient buffer -- which is the fp32 master shard's gradient -- and gradients are
zeroed, never set to None. Per parameter a replica holds 4 bytes of parameter, 4 of
gradient and 12/dp of master + two moments: (8 + 12/dp) bytes plus bucket padding
(tests/distributed/test_zero.py counts it from tensor storages). Under ``bf16-mixed``
the updated slices travel in bf16 (``gather_dtype``: half the bytes) into a bf16
gather buffer (2 more bytes per parameter) whose slices are copied into the
parameters, which then hold bf16-rounded values -- what autocast feeds the matmuls
anyway -- while the fp32 masters stay in the optimizer and in checkpoints.
The gradient norm for clipping comes from the reduced shards:
each element counts once over the world (TP-replicated elements are weighted by
1/tp because every TP rank holds them).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..base.dtensor import is_sharded, local_block
from ..comm.buckets import FlatBuckets, bucket_numel
from ..comm.engine import BucketedSync, make_collectives
from ..comm.partial_grads import PartialGradients
from ..comm.trace import CommTrace
from ..config import CommConfig, OptimConfig
from .flat_chunks import range_boxes, sharded_chunks
from .offload import HostMasters

MOMENTS = ("exp_avg", "exp_avg_sq")


def adamw(groups: list[dict], cfg: OptimConfig) -> torch.optim.AdamW:
    """torch's fused AdamW: one kernel for all tensors, and its step counters live on the device, so a
    step reads nothing back (the foreach version calls ``.item()`` on every counter). Foreach where a
    device has no fused kernel."""
    devices = {p.device.type for g in groups for p in g["params"]}
    fused = all(t in ("cuda", "cpu") for t in devices)
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None, foreach=None if fused else True
    )


class ZeroOneOptimizer:
    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        cfg: OptimConfig,
        dp_group,
        dp: int,
        dp_rank: int,
        tp: int,
        comm: CommConfig | None = None,
        stage_of: dict[int, int] | None = None,
        partial_grads: PartialGradients | None = None,
        tp_group=None,
        trace: CommTrace | None = None,
        comm_group=None,
        gather_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        offload: bool = False,
    ):
        """``device``: where this rank's buffers live (the engine's device). A rank whose parameters are all
        frozen holds none to take it from, and its empty buffers still join collectives (NCCL: on the GPU).
        ``offload`` (parallel.offload=optimizer, ZeRO-Offload): the fp32 master shards and AdamW's moments live
        in host memory (pinned on CUDA) and the step runs there (parallel/offload.py)."""
        comm = comm or CommConfig(overlap_grad_reduce=False, overlap_param_gather=False)
        self.group, self.dp, self.dp_rank = dp_group, dp, dp_rank
        self.trace = trace
        decay = [(n, p) for n, p in named_params if p.requires_grad and p.ndim >= 2]
        no_decay = [(n, p) for n, p in named_params if p.requires_grad and p.ndim < 2]
        if device is None:
            device = named_params[0][1].device if named_params else torch.device("cpu")
        size, graded = bucket_numel(comm.bucket_mb), comm.graded_buckets
        self.flats = {
            "decay": FlatBuckets(decay, dp, dp_rank, tp, size, device, graded),
            "no_decay": FlatBuckets(no_decay, dp, dp_rank, tp, size, device, graded),
        }
        self.sync = BucketedSync(
            self.flats,
            make_collectives(comm.collectives, dp_group, dp, dedicated_group=comm_group),
            dp,
            overlap_grad_reduce=comm.overlap_grad_reduce,
            overlap_param_gather=comm.overlap_param_gather,
            skip_collectives=comm.skip_collectives,
            stage_of=stage_of,
            partial_grads=partial_grads,
            tp_group=tp_group,
            trace=trace,
            order=[p for _, p in named_params],
            order_group=dp_group,
            gather_dtype=gather_dtype,
        )
        self.offloaded = HostMasters(self.flats.values()) if offload else None  # after bind: the device grads
        groups = [
            {"params": self.flats["decay"].masters, "weight_decay": cfg.weight_decay, "name": "decay"},
            {"params": self.flats["no_decay"].masters, "weight_decay": 0.0, "name": "no_decay"},
        ]
        self.inner = adamw(groups, cfg)
        # Expert parallelism: the experts this rank holds are stepped by their own optimizer (differently
        # replicated: train/expert_optim.py), driven from here so the trainer sees one optimizer.
        self.experts = None

    @property
    def param_groups(self):
        return self.inner.param_groups

    def reduce_gradients(self) -> None:
        """Sum gradients over the replicas; keep this replica's shard as the master gradient."""
        self.sync.finish_grads()
        if self.offloaded is not None:  # the reduced shards to the host masters' gradients (one wait)
            self.offloaded.fetch_grads()
        if self.experts is not None:
            self.experts.reduce_gradients()

    def grad_norm_squared(self) -> torch.Tensor:
        """This rank's share of the global squared gradient norm (sum it over the world)."""
        total = sum(flat.squared_grad_norm() for flat in self.flats.values())
        if self.experts is not None:
            total = total + self.experts.grad_norm_squared().to(total.device)
        return total

    def master_params(self) -> list[torch.nn.Parameter]:
        """This replica's fp32 master slices (what clipping scales: their gradients are views)."""
        experts = self.experts.params if self.experts is not None else []
        return [m for flat in self.flats.values() for m in flat.masters] + experts

    def step(self) -> None:
        started = self.trace.now() if self.trace is not None else None
        self.inner.step()
        if self.experts is not None:
            self.experts.step(self.inner.param_groups[0]["lr"])
        if self.trace is not None:
            self.trace.compute("optimizer", started, self.trace.now())
        self.sync.gather_params()  # the new weights arrive during the next forward (or now, without overlap)

    def close(self) -> None:
        """Finish in-flight gathers, remove the hooks and stop the communication thread."""
        self.sync.close()

    def wait_params(self) -> None:
        """Finish in-flight parameter gathers (before anything reads the parameters outside a forward)."""
        self.sync.wait_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers. ``set_to_none`` is accepted for torch's signature and ignored:
        the parameters' and masters' gradients are views of those buffers and stay bound."""
        self.sync.zero_grads()
        if self.experts is not None:
            self.experts.zero_grad()

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (master shard + moments)."""
        total = 0
        for master in (m for flat in self.flats.values() for m in flat.masters):
            total += master.numel() * master.element_size()
            for value in self.inner.state.get(master, {}).values():
                if torch.is_tensor(value) and value.numel() > 1:
                    total += value.numel() * value.element_size()
        return total

    def sync_master_from_params(self) -> None:
        """Refresh the fp32 master shards after parameters were loaded from a checkpoint."""
        self.sync.wait_params()
        with torch.no_grad():
            for name, flat in self.flats.items():
                full = flat.gather_params()
                self.sync.param_flat[name].copy_(full)
                for bucket, master in zip(flat.buckets, flat.masters, strict=True):
                    master.copy_(bucket.slice_of(full, flat.rank))

    # ------------------------------------------------------------ checkpoints
    def ensure_state(self) -> None:
        """Create AdamW's state as its first step would (zero moments, step 0), so a checkpoint can be saved
        or loaded before any step; the first step then finds it and proceeds exactly as from scratch."""
        for master in self.master_params():
            if not self.inner.state.get(master):
                self.inner.state[master] = {
                    "step": torch.zeros((), dtype=torch.float32, device=master.device),  # fused: on the device
                    **{key: torch.zeros_like(master, memory_format=torch.preserve_format) for key in MOMENTS},
                }

    def checkpoint_state(self, rank: int, world: int, saving: bool) -> dict:
        """This replica's master values and moments as checkpoint chunks (parallel/flat_chunks.py) keyed
        ``model.<name>``, ``optim.<name>.exp_avg`` / ``exp_avg_sq``, plus ``optim.<name>.step`` (0-d).

        The chunks are views into the optimizer's tensors: a load writes in place (call
        :meth:`checkpoint_loaded` after it). Elements replicated over the tensor-parallel group are saved by
        TP rank 0 only (one copy of every element) and loaded by every TP rank."""
        self.ensure_state()
        tp_rank = dist.get_rank(self.sync.tp_group) if saving and self.sync.tp_group is not None else 0
        state: dict = {}
        self._loaded_steps: dict[int, torch.Tensor] = {}
        for flat in self.flats.values():
            for index, ((name, param), tensor) in enumerate(zip(flat.params, flat.locals, strict=True)):
                if tp_rank != 0 and not is_sharded(param):
                    continue
                bucket = flat.buckets[flat.bucket_of[index]]
                own = bucket.offset + flat.rank * bucket.shard_size
                offset = flat.offsets[index]
                start, stop = max(offset, own), min(offset + tensor.numel(), own + bucket.shard_size)
                if start >= stop:
                    continue
                master = flat.masters[bucket.index]
                moments = self.inner.state[master]
                sources = {"model": master.detach(), **{key: moments[key] for key in MOMENTS}}
                pieces: dict[str, list] = {key: [] for key in sources}
                _, block_offset = local_block(param)
                for offsets, sizes, first in range_boxes(tuple(tensor.shape), start - offset, stop - offset):
                    at = tuple(a + b for a, b in zip(offsets, block_offset, strict=True))
                    low = offset + first - own
                    for key, source in sources.items():
                        pieces[key].append((at, source[low : low + math.prod(sizes)].view(sizes)))
                size = param.shape  # a DTensor's shape is the full parameter's
                state[f"model.{name}"] = sharded_chunks(pieces["model"], size, rank, world)
                for key in MOMENTS:
                    state[f"optim.{name}.{key}"] = sharded_chunks(pieces[key], size, rank, world)
                if saving:
                    state[f"optim.{name}.step"] = moments["step"]
                else:  # one loaded counter per bucket is enough: every parameter of a flat steps together
                    # holding the live count until a load overwrites it: a replica group sends this state as it
                    # is to a group that joins (train/fault_tolerance/), which needs the count, not a zero
                    counter = moments["step"].detach().to("cpu", torch.float32)
                    step = self._loaded_steps.setdefault(id(master), counter.clone())
                    state[f"optim.{name}.step"] = step
        if self.experts is not None:
            state.update(self.experts.checkpoint_state(saving))
        return state

    def mixed_buckets(self, absent: set[str]) -> list[str]:
        """Parameters of this replica's buckets whose optimizer state a load did not find (``absent``: the
        missing ``optim.<name>.step`` keys) while other members' was found: fused AdamW steps a bucket with
        one counter, so these skip Adam's bias correction at first (larger early updates)."""
        fresh = []
        for flat in self.flats.values():
            for bucket in flat.buckets:
                names = [flat.params[i][0] for i in bucket.members]
                missing = [n for n in names if f"optim.{n}.step" in absent]
                if missing and len(missing) < len(names):
                    fresh += missing
        return fresh

    def checkpoint_loaded(self) -> None:
        """After a load into :meth:`checkpoint_state`'s chunks: step counters in place, and the parameters
        all-gathered from the loaded masters."""
        for master in self.master_params():
            step = self._loaded_steps.get(id(master))
            if step is not None:
                self.inner.state[master]["step"].copy_(step)
        self._loaded_steps = {}
        self.sync.gather_params()
        self.sync.wait_params()
