"""Bytes of model state a rank holds, per shard mode: the one memory model of the planner, of
``tools/memory.py`` and of the rehearsal (``trainer.dry_run=true``), written from what the runtime
allocates (parallel/zero.py, parallel/fsdp.py, train/engine.py).

Per parameter of this rank's stage slice (``local``: after TP and PP, before DP sharding), of which
``trainable`` have gradients, with ``dp`` replicas (``S = dp / hsdp_replicas`` ranks per shard group):

=========  ========  ==========  ===========  ==========  ============================================
shard      params    gradients   fp32 master  Adam m, v   buffers
=========  ========  ==========  ===========  ==========  ============================================
none       4         4           --           8           -- (DDP: gradients are bucket views)
zero1      4         4           4 / dp       8 / dp      2 (the bf16 gather buffer, bf16 wire only)
zero2/3    4 / S     4 / S       --           8 / S       --
=========  ========  ==========  ===========  ==========  ============================================

The Adam column is the optimizer's state: 8 bytes for AdamW; ``optim=sgd`` holds 4 (its momentum buffer) or
none without momentum (``moment_bytes``). Local SGD (``parallel.mode=local_sgd``, train/local_sgd/sync.py)
adds, per process, its 1/shard_group share of the fp32 anchors (4 bytes per trainable parameter / shard_group,
counted as master) and of the outer momentum (4 / shard_group when the outer step has momentum, counted as
moments): split by bytes under DDP and ZeRO-1, each process's shard under FSDP2. Sharded workers (zero1, zero2,
zero3) are counted with ``hsdp_replicas`` = the number of workers, so S = dp / hsdp_replicas = shard_group (for
zero1 too: its optimizer is split over one worker's processes).

Frozen parameters count in ``params`` only. Parameters are fp32 everywhere and are the master weights
except under ZeRO-1, whose optimizer keeps fp32 master slices (a bf16 wire leaves the parameters with
bf16-rounded values). Padding (ZeRO-1 buckets to a multiple of dp, FSDP2 dim-0 shards to a multiple
of S) is below 1% for any real model and is not modelled.

Context and expert parallelism (``unit_model_state``): the rows above apply to each of two parameter sets
with its own ``dp``. Gradients are reduced over the dp x cp ranks of a stage (context-parallel ranks' losses
cover disjoint positions), so that is the ZeRO group of every non-expert parameter; a rank holds ``1/ep``
of the routed experts (parallel/expert_parallel.py), replicated on the dp x cp / ep ranks with the same expert
shard and stepped there by an AdamW of their own: fp32 parameters, gradients and moments, no master copy.

Besides the state, while a step runs (``transient``):

* zero3 holds the unsharded parameters of the FSDP group in compute and the next one (prefetch), and
  one group's unsharded gradients while it is reduce-scattered (the last block and the LM head, kept gathered
  from their forward to their backward, are the two groups of the head's forward: parallel/fsdp.py
  ``kept_after_forward``); zero2 (the Playbook's ZeRO-2) holds the
  stage's unsharded parameters through the step and between steps (gathered after each optimizer step), and
  one group's unsharded gradients while it is reduce-scattered;
  under a pipeline (more than one schedule stage) both keep the stage's whole gathered parameters and its
  unreduced gradients through the step, gathered once and reduced once (parallel/fsdp.py ``FsdpStepSync``);
* with optimizer offload (``zero1+offload``, ``zero2+offload``, ``zero3+offload``: parallel/offload.py, FSDP2's
  CPUOffloadPolicy) the state above leaves the device as ``model_state`` says; the transients stay;
* under bf16-mixed with fp32 parameters in the compute (none, zero1, or FSDP2 with an fp32 wire),
  autocast keeps one bf16 copy of every weight of the stage: the units engine runs a whole step in
  one autocast region (its cache lives until the region ends), so in-flight microbatches share the
  copy their backward needs (one region per microbatch would keep one copy per in-flight microbatch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..parallel.fsdp import FSDP_MODES as FSDP
from ..parallel.fsdp import SHARD_MODES as SHARDS

OFFLOADED = "+offload"  # a planner shard mode with the optimizer on the host: "zero1+offload", "zero3+offload"


def split_shard(shard: str) -> tuple[str, bool]:
    """(the runtime's shard mode, whether the optimizer is offloaded) of a planner shard mode."""
    if shard.endswith(OFFLOADED):
        return shard[: -len(OFFLOADED)], True
    return shard, False


@dataclass(frozen=True)
class ModelState:
    """Bytes one rank holds between steps."""

    params: float
    grads: float
    master: float
    moments: float
    buffers: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master + self.moments + self.buffers

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}

    def __add__(self, other: ModelState) -> ModelState:
        return ModelState(
            self.params + other.params,
            self.grads + other.grads,
            self.master + other.master,
            self.moments + other.moments,
            self.buffers + other.buffers,
        )


def model_state(
    local: float,
    trainable: float,
    dp: int,
    shard: str,
    hsdp_replicas: int = 1,
    wire_bytes: int = 4,
    moment_bytes: float = 8.0,
    outer: tuple[float, float] = (0.0, 0.0),
) -> ModelState:
    """``moment_bytes``: the optimizer's state per trainable parameter; ``outer``: local SGD's (anchor, outer
    momentum) bytes per trainable parameter on this process (already divided by the shard group). A shard mode
    with ``+offload`` (parallel.offload=optimizer) keeps on the device only what stays there: ZeRO-1 its
    parameters, gradient buffer and gather buffer (the master shard and moments are on the host); FSDP2 nothing
    between steps (its sharded parameters, gradients and optimizer state are on the host; the gathered ones are
    ``transient_bytes``)."""
    shard, offloaded = split_shard(shard)
    if shard not in SHARDS or (offloaded and shard == "none"):
        raise ValueError(f"shard={shard!r}: allowed values are {', '.join(SHARDS)} (and zero1/2/3{OFFLOADED})")
    if offloaded:
        state = model_state(local, trainable, dp, shard, hsdp_replicas, wire_bytes, moment_bytes, outer)
        if shard == "zero1":
            return ModelState(state.params, state.grads, 0.0, 0.0, state.buffers)
        return ModelState(0.0, 0.0, 0.0, 0.0, 0.0)
    anchors, momentum = outer[0] * trainable, outer[1] * trainable
    m = moment_bytes
    if shard == "none":
        return ModelState(4.0 * local, 4.0 * trainable, anchors, m * trainable + momentum, 0.0)
    # hsdp_replicas > 1: FSDP2's HSDP, or local SGD's sharded workers (zero1 too: its optimizer is split over
    # a worker's dp / hsdp_replicas processes); the anchors and outer momentum are a share (outer: / S already)
    shards = max(1, dp // hsdp_replicas)
    if shard == "zero1":
        buffers = 2.0 * trainable if wire_bytes == 2 else 0.0
        master = 4.0 * trainable / shards + anchors
        return ModelState(4.0 * local, 4.0 * trainable, master, m * trainable / shards + momentum, buffers)
    return ModelState(4.0 * local / shards, 4.0 * trainable / shards, anchors, m * trainable / shards + momentum, 0.0)


def optimizer_state_bytes(cfg) -> tuple[float, tuple[float, float]]:
    """(moment bytes per trainable parameter, local SGD's (anchor, outer momentum) bytes) of a config: what
    train/optim.py and train/local_sgd/sync.py allocate."""
    o = cfg.optim
    moments = 8.0 if o.name != "sgd" else (4.0 if o.momentum > 0 else 0.0)
    if cfg.parallel.mode != "local_sgd":
        return moments, (0.0, 0.0)
    from ..parallel.plan import local_sgd_shard_group

    ls, shard = cfg.parallel.local_sgd, local_sgd_shard_group(cfg)
    if ls.offload:  # in host memory (train/local_sgd/sync.py): no device bytes
        return moments, (0.0, 0.0)
    outer_momentum = ls.method != "post_local_sgd" and ls.outer_momentum > 0
    return moments, (4.0 / shard, (4.0 if outer_momentum else 0.0) / shard)


def unit_model_state(
    dense: float,
    experts: float,
    trainable_fraction: float,
    gradient_ranks: int,
    ep: int,
    shard: str,
    hsdp_replicas: int = 1,
    wire_bytes: int = 4,
) -> ModelState:
    """``model_state`` of a rank holding ``dense`` non-expert parameters, reduced over ``gradient_ranks``
    (dp x cp) ranks, and ``experts`` routed-expert parameters (its 1/ep), reduced over gradient_ranks / ep.
    Under expert parallelism (ep > 1; the rest ZeRO-1 or FSDP2, which ignores the experts) the held experts
    are stepped by their own AdamW on every replica (train/expert_optim.py): fp32 parameters that are their own
    masters, full gradients and moments, no wire copy."""
    if gradient_ranks % ep:
        raise ValueError(f"ep={ep} does not divide the {gradient_ranks} data x context ranks")
    state = model_state(dense, dense * trainable_fraction, gradient_ranks, shard, hsdp_replicas, wire_bytes)
    if experts and ep > 1:
        held = experts * trainable_fraction
        state = state + ModelState(4.0 * experts, 4.0 * held, 0.0, 8.0 * held, 0.0)
    elif experts:
        expert_ranks = gradient_ranks // ep
        replicas = max(1, min(hsdp_replicas, expert_ranks))
        state = state + model_state(experts, experts * trainable_fraction, expert_ranks, shard, replicas, wire_bytes)
    return state


def transient_bytes(
    local: float,
    largest_group: float,
    shard: str,
    in_flight: int,
    mixed: bool,
    wire_bytes: int = 4,
    pipelined: bool = False,
) -> float:
    """Bytes a rank holds during a step beyond the model state and the activations (see the module doc).
    ``largest_group``: parameters of the largest FSDP group (a block, the embedding or the LM head).
    ``pipelined``: FSDP2 under a pipeline keeps the stage's gathered parameters and its unreduced gradients
    through the step (parallel/fsdp.py ``FsdpStepSync``). FSDP2 with offload gathers on the device as without
    it (the host shard is copied up first: not counted, ``1 / S`` of a group)."""
    shard = split_shard(shard)[0]
    gathered = 0.0
    if shard in FSDP and pipelined:
        gathered = local * wire_bytes + 4.0 * local
    elif shard == "zero3":
        gathered = 2 * largest_group * wire_bytes + 4.0 * largest_group
    elif shard == "zero2":
        gathered = local * wire_bytes + 4.0 * largest_group
    fp32_compute = shard not in FSDP or wire_bytes == 4
    copies = 2.0 * local if mixed and fp32_compute else 0.0  # one region per step: one copy (module doc)
    return gathered + copies


def standard_model_state(params: float, dp: int = 1, stage: int = 0, fp32_grad_accumulation: bool = False) -> dict:
    """The textbook mixed-precision model state per rank (the ZeRO paper; the Ultra-Scale Playbook): bf16
    parameters (2) and gradients (2), fp32 master weights and Adam moments (12) = 16 bytes per parameter;
    accumulating gradients in fp32 adds a 4-byte gradient buffer (20). ZeRO stage 1 shards the optimizer
    part over ``dp``, stage 2 the gradients too, stage 3 the parameters too. Not this runtime's layout
    (fp32 parameters that are the master weights and fp32 gradients: ``model_state``): the reference
    tools/memory.py reproduces (``convention=standard``)."""
    params_b = 2.0 * params
    grads_b = (6.0 if fp32_grad_accumulation else 2.0) * params
    optimizer = 12.0 * params
    if stage >= 1:
        optimizer /= dp
    if stage >= 2:
        grads_b /= dp
    if stage >= 3:
        params_b /= dp
    return {"params": params_b, "grads": grads_b, "optimizer": optimizer, "total": params_b + grads_b + optimizer}
