"""ZeRO-2, ZeRO-3 and HSDP of one parallelism unit with torch's FSDP2 (``fully_shard``).

``parallel.units.<unit>.shard`` (``parallel.shard`` for ddp / megatron layouts) chooses how a unit's
model state is spread over its data-parallel replicas:

* ``none``  -- torch DDP and a replicated AdamW (pure data parallelism only; train/engine.py);
* ``zero1`` -- ZeRO-1 (parallel/zero.py): parameters and gradients replicated as views of flat
  buckets, fp32 master weights and Adam moments sharded;
* ``zero2`` -- the Playbook's ZeRO-2 on FSDP2: gradients and optimizer state sharded, parameters
  replicated. The updated shards are all-gathered right after each optimizer step (in the background:
  each group's next pre-forward waits for its gather) and stay gathered through the next step's
  microbatches (``FsdpStepSync``: no reshard after forward or after a microbatch's backward); every
  microbatch's backward reduce-scatters its gradients into the sharded gradient, so no rank holds a whole
  gradient between microbatches. The stage's last backward of a step reshards (the optimizer steps the
  shards), and a checkpoint saves and loads the shards (``ShardedOptimizer.shard_params``).
* ``zero3`` -- FSDP2 with ``reshard_after_forward=True``: a block's parameters are freed after its
  forward and gathered again for its backward, per microbatch; the stage's last block, LM head and root
  group stay gathered from their forward to their backward, which follows at once (TorchTitan's default:
  ``kept_after_forward``).

zero2 holds a rank's 16/S bytes per parameter of sharded state (S = dp / hsdp_replicas ranks share one
copy) plus the stage's gathered parameters, from the step's end through the next step's backward; zero3
holds at most the blocks being computed and prefetched. The memory model (planner/memory.py) counts that.

Blocks (the recompute families: Llama decoder blocks, ViT blocks, U-Net blocks), embeddings and the
LM head are FSDP groups of their own; the rest of a stage (norms, projectors, small layers) is the
stage's root group. Gradients are *summed* over the replicas (``set_gradient_divide_factor(1)``):
the loss is already normalized by the global batch's token count, as in every engine.

HSDP (``hsdp_replicas`` = R > 1): the unit's dp replicas form an R x (dp / R) mesh; state is sharded
over dp / R ranks and replicated R times, gradients are reduce-scattered in the shard dimension and
all-reduced in the replicate dimension. With tensor parallelism the mesh gets a ``tp`` dimension
(2-D FSDP + TP, or 3-D HSDP + TP): TP parameters are DTensors on the ``tp`` sub-mesh and FSDP2 shards
them further over the data-parallel dimension(s).

Under a pipeline (more than one schedule stage) a step runs many microbatches through each stage, and FSDP2's
per-microbatch all-gather and reduce-scatter would repeat for each; ``FsdpStepSync`` runs it as TorchTitan's
pipeline schedules do: a stage gathers its parameters in its first forward of the step and keeps them (no
reshard after forward or backward), sums its microbatches' gradients unreduced, and its last backward of the
step reduce-scatters them and reshards. Between steps the state is sharded as above; during a step the stage
holds its whole parameters and gradients (the memory model counts that: planner/memory.py).

Under bf16-mixed with a bf16 wire (``parallel.comm.wire_dtype``) parameters are all-gathered in bf16
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); gradients are reduced in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm.partial_grads import PartialGradients
from ..config import OptimConfig
from .recompute import BLOCKS
from .zero import adamw

SHARD_MODES = ("none", "zero1", "zero2", "zero3")
FSDP_MODES = ("zero2", "zero3")


def unit_meshes(unit, pp_rank: int, groups, device_type: str):
    """(FSDP mesh, TP mesh or None) of this rank's (unit, pipeline stage), sliced from one root mesh built
    from existing process groups (every rank of the unit builds it; no new groups)."""
    from torch.distributed.device_mesh import DeviceMesh

    dp, tp, cp, replicas = unit.dp, unit.tp, unit.cp, unit.hsdp_replicas
    # context-parallel ranks hold the same parameters as their replica and their gradients add up as replicas'
    # do: FSDP2 shards over the data x context ranks (the gradient group), replica-major
    ranks = torch.tensor([[unit.rank(d, t, pp_rank, c) for t in range(tp)] for d in range(dp) for c in range(cp)])
    if replicas > 1:
        ranks = ranks.view(replicas, dp // replicas, tp)
        names, pgs = ["replicate", "shard"], [groups.hsdp_replicate, groups.hsdp_shard]
    else:
        names, pgs = ["shard"], [groups.gradient if cp > 1 else groups.data_parallel]
    if tp > 1:
        names.append("tp")
        pgs.append(groups.tensor_parallel)
    else:
        ranks = ranks.squeeze(-1)
    root = DeviceMesh.from_group(pgs if len(pgs) > 1 else pgs[0], device_type, mesh=ranks, mesh_dim_names=tuple(names))
    if len(names) == 1:
        return root, None
    fsdp = root["replicate", "shard"] if replicas > 1 else root["shard"]
    return fsdp, (root["tp"] if tp > 1 else None)


def fsdp_groups(stage: nn.Module) -> list[nn.Module]:
    """The submodules that get FSDP groups of their own, children before parents (then the stage itself)."""
    picked = []
    for name, module in stage.named_modules():
        if isinstance(module, BLOCKS) or isinstance(module, nn.Embedding) or name.endswith("llm.output"):
            picked.append(module)
    return list(reversed(picked))


def kept_after_forward(stage: nn.Module) -> list[nn.Module]:
    """The FSDP groups zero3 keeps gathered after their forward, as TorchTitan does by default: the stage's last
    block, its LM head and the stage's root group (the final norm, projectors: FSDP2's own default for a root).
    Their backward is the first to run after the forward, so resharding them would only gather them again at
    once: keeping them saves one all-gather of each per microbatch and costs no memory at the peak (the memory
    model's two gathered groups: the last block and the head in the head's forward, then in its backward)."""
    blocks = [module for module in stage.modules() if isinstance(module, BLOCKS)]
    heads = [module for name, module in stage.named_modules() if name.endswith("llm.output")]
    return [*blocks[-1:], *heads, stage]


def reshard_settings(stage: nn.Module, groups: list[nn.Module], mode: str) -> dict[int, bool]:
    """FSDP2's ``reshard_after_forward`` of each of ``groups`` (of ``stage``) under ``mode``, by id: zero2 never
    reshards, zero3 every group but ``kept_after_forward``'s."""
    kept = {id(module) for module in kept_after_forward(stage)}
    return {id(group): mode == "zero3" and id(group) not in kept for group in groups}


def apply_fsdp(
    stage: nn.Module,
    mesh,
    mode: str,
    param_dtype: torch.dtype | None,
    ignored: set[nn.Parameter] | None = None,
    offload: bool = False,
) -> None:
    """Shard ``stage`` (still on the meta device: shard before materialize) with FSDP2. ``ignored``: parameters
    FSDP2 leaves whole and unreduced (expert parallelism's experts: each EP rank holds different ones, stepped
    by train/expert_optim.py). ``offload`` (parallel.offload=optimizer): torch's ``CPUOffloadPolicy`` -- the
    sharded parameters, their gradients and so the optimizer's state and step on the host (pinned on CUDA),
    each group's shards copied to the device for its all-gather; materialize the stage on the host
    (parallel/stages.py ``build_rank_stages`` ``param_device``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if mode not in FSDP_MODES:
        raise ValueError(f"shard={mode!r} is not an FSDP2 mode ({', '.join(FSDP_MODES)})")
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype if param_dtype != torch.float32 else None,
        reduce_dtype=torch.float32,
        cast_forward_inputs=False,  # inputs stay as they are: autocast decides (diffusion targets stay fp32)
    )
    groups = [*fsdp_groups(stage), stage]
    reshard = reshard_settings(stage, groups, mode)
    placement = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    for module in groups:
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard[id(module)],
            mp_policy=policy,
            ignored_params=ignored,
            offload_policy=placement,
        )
        module.set_gradient_divide_factor(1.0)  # sum over replicas: the loss is normalized globally
        module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)


def fsdp_modules(stages) -> list[nn.Module]:
    """Every FSDP2 group of ``stages`` (modules that ``fully_shard`` wrapped)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for stage in stages for m in stage.modules() if isinstance(m, FSDPModule)]


class FsdpStepSync:
    """The executor's ``grad_sync`` for FSDP2 stages gathered once per step (schedule/executor.py calls
    ``begin_step`` before a step and ``arm(stage)`` before a stage's last backward of it): each FSDP group is
    all-gathered in its first forward of the step and kept through the step's microbatches, and resharded after
    the stage's last backward. ``defer_reduce`` (a pipeline, as TorchTitan runs FSDP2 under one): the
    microbatches' gradients are summed unreduced and reduce-scattered once, in the last backward; else (zero2
    without a pipeline, the Playbook's ZeRO-2) every microbatch's backward reduce-scatters into the sharded
    gradient, so no whole gradient outlives a microbatch. ``mode``: zero2 or zero3, whose own per-group
    ``reshard_after_forward`` (``reshard_settings``) is restored at a stage's last backward so forwards
    outside a step (evaluation, sampling) reshard as they would without it."""

    def __init__(self, stages: dict[int, nn.Module], mode: str, defer_reduce: bool = True):
        from torch.distributed.fsdp import FSDPModule

        self.groups = {s: [m for m in stage.modules() if isinstance(m, FSDPModule)] for s, stage in stages.items()}
        # each group's own setting (apply_fsdp's), restored at the stage's last backward
        self.after_forward = {}
        for s, stage in stages.items():
            self.after_forward.update(reshard_settings(stage, self.groups[s], mode))
        self.defer_reduce = defer_reduce

    def _final(self, groups: list, final: bool) -> None:
        for group in groups:
            group.set_requires_gradient_sync(final or not self.defer_reduce, recurse=False)
            group.set_reshard_after_backward(final, recurse=False)

    def begin_step(self) -> None:
        for groups in self.groups.values():
            for group in groups:
                group.set_reshard_after_forward(False, recurse=False)
            self._final(groups, False)

    def arm(self, stage: int = 0) -> None:
        groups = self.groups.get(stage, [])
        self._final(groups, True)
        for group in groups:  # the stage runs no forward after its last backward of the step
            group.set_reshard_after_forward(self.after_forward[id(group)], recurse=False)

    def grads_ready(self, params) -> None:
        """FSDP2's own hooks reduce the gradients."""


def _distinct_shards(param) -> int:
    """Over how many ranks ``param`` is split (the product of its mesh's Shard dimensions)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(param, DTensor):
        return 1
    count = 1
    for size, placement in zip(param.device_mesh.shape, param.placements, strict=True):
        if not isinstance(placement, Replicate):
            count *= size
    return count


class ShardedOptimizer:
    """AdamW on FSDP2's sharded (DTensor) parameters; the optimizer interface the units engine drives."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        cfg: OptimConfig,
        copies: int,
        partial_grads: PartialGradients | None = None,
        device=None,
        regather=(),
    ):
        """``device``: the engine's (a rank whose parameters are all frozen still reduces a norm there).
        ``regather``: FSDP groups gathered again right after every step (zero2, the Playbook's ZeRO-2: parameters
        replicated between steps; the gathers run in the background and the next forward waits for them).
        ``copies``: the ranks of this unit stage (dp x cp x tp); each element of a parameter lives on
        copies / (its distinct shards) of them, and counts that many times less in the gradient norm (a
        norm weight is split over the FSDP mesh and replicated over TP; HSDP replicates everything R
        times). ``partial_grads``: sequence-parallel parameters whose gradients are partial sums over TP."""
        self.named_params = [(n, p) for n, p in named_params if p.requires_grad]
        self.partial = partial_grads if partial_grads is not None else PartialGradients()
        self.device = device if device is not None else (self.named_params[0][1].device if self.named_params else None)
        decay = [p for _, p in self.named_params if p.ndim >= 2]
        no_decay = [p for _, p in self.named_params if p.ndim < 2]
        groups = [
            {"params": decay, "weight_decay": cfg.weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
        ]
        # a rank whose parameters are all frozen keeps one empty group: the scheduler and the loop still step it
        self.inner = adamw([g for g in groups if g["params"]] or groups[:1], cfg)
        self.weights = {id(p): _distinct_shards(p) / copies for _, p in self.named_params}
        # Expert parallelism: the held experts' own optimizer (train/expert_optim.py), driven from here as
        # ZeroOneOptimizer drives it: one learning rate, one gradient norm, one checkpoint.
        self.experts = None
        self.regather = list(regather)
        self.pending: list = []  # the regather's in-flight all-gathers

    @property
    def param_groups(self):
        return self.inner.param_groups

    def reduce_gradients(self) -> None:
        """FSDP2 reduce-scattered every backward already (waited for at the end of each backward); only the
        sequence-parallel partial sums are completed over TP (a sum, so after the reduce-scatter is fine) and the
        experts' gradients summed over the ranks holding them."""
        if self.experts is not None:
            self.experts.reduce_gradients()
        self.partial.complete_all()

    def grad_norm_squared(self) -> torch.Tensor:
        """This rank's share of the global squared gradient norm (replicated elements weighted)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device or torch.device("cpu"))
        for _, param in self.named_params:
            if param.grad is not None:
                grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
                total += self.weights[id(param)] * torch.linalg.vector_norm(grad, dtype=torch.float64).square()
        if self.experts is not None:
            total += self.experts.grad_norm_squared().to(total.device)
        return total

    def master_params(self) -> list[nn.Parameter]:
        experts = self.experts.params if self.experts is not None else []
        return [p for _, p in self.named_params if p.grad is not None] + experts

    def step(self) -> None:
        self.inner.step()
        if self.experts is not None:
            self.experts.step(self.inner.param_groups[0]["lr"])
        # the updated shards gathered now (FSDP2 waits for them in each group's next pre-forward)
        self.pending = [group.unshard(async_op=True) for group in self.regather]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        if self.experts is not None:
            self.experts.zero_grad()

    def wait_params(self) -> None:
        """Finish the regather's all-gathers (FSDP2 itself gathers parameters in the forward)."""
        for handle in self.pending:
            handle.wait()
        self.pending = []

    def shard_params(self) -> None:
        """The modules' parameters back to their shards (what checkpoints save and load into)."""
        self.wait_params()
        for group in self.regather:
            group.reshard()

    def close(self) -> None:
        self.wait_params()

    def sync_master_from_params(self) -> None:
        """The sharded parameters are the master weights: nothing to copy."""

    def state_bytes(self) -> int:
        total = 0
        for state in self.inner.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.numel() > 1:
                    value = value.to_local() if hasattr(value, "to_local") else value
                    total += value.numel() * value.element_size()
        return total
