"""The outer step of local SGD, unit by unit: all at once after the optimizer step, or -- EDiT's layer-wise
sync (``parallel.local_sgd.layerwise``) -- during the next forward, each decoder block's parameters synced
just before the block runs, the next block's reduction already in flight (prefetched one block ahead) so it
overlaps this block's compute.

Units in forward order: unit 0 is every parameter outside the decoder blocks (embeddings, output head, norms,
encoder, generator: synced before the forward starts), unit i the i-th decoder block. Per unit, a process
reduces the pseudo-gradients of the parameters it owns over its sync group (one flat all-reduce), steps their
anchors with the unit's outer optimizer, takes the anchors and broadcasts them inside its worker. Both timings
apply the same operations to the same values: after a sync step no parameter changes until the next forward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ...base.dtensor import local
from ...models.llama import DecoderBlock


class OuterSync:
    def __init__(
        self,
        model: torch.nn.Module,
        named_parameters: list[tuple[str, torch.nn.Parameter]],
        owner_of: dict[str, int],
        place: int,
        worker_first_rank: int,
        sync_group,
        worker_group,
        workers: int,
        shard: int,
        outer: dict,
        layerwise: bool,
        penalty=None,
        worker: int = 0,
        offload: bool = False,
        sharded: bool = False,
    ):
        """``owner_of``: the place (index inside a worker) that syncs each parameter; ``outer``: torch SGD's
        lr, momentum and nesterov for every unit's outer optimizer; ``offload``: anchors (pinned when the
        parameters are on CUDA) and outer momentum in host memory: a sync brings a unit's anchors to the device
        for its pseudo-gradient, takes the reduced pseudo-gradient to the host for the outer step there, and
        copies the new anchors back into the parameters. ``sharded`` (FSDP2 inside the worker): every process
        owns the local shard of every parameter (a DTensor): pseudo-gradients, anchors and outer momentum are
        those shards, and no broadcast follows (FSDP2 gathers the new shards in the next forward)."""
        self.place, self.first, self.workers, self.shard = place, worker_first_rank, workers, shard
        self.sync_group, self.worker_group = sync_group, worker_group
        self.owner_of = owner_of
        self.worker = worker
        self.sharded = sharded
        # EDiT's penalty (train/local_sgd/penalty.py), or None: the plain mean of the pseudo-gradients
        self.penalty = penalty if penalty is not None and penalty.active else None
        self.verdicts: list[dict] = []  # per unit of each sync since last read: norms, flags, weights
        self.device = next(p.device for _, p in named_parameters)
        blocks = [m for m in model.modules() if isinstance(m, DecoderBlock)]
        unit_of = {id(p): i + 1 for i, block in enumerate(blocks) for p in block.parameters()}
        self.units: list[list[tuple[str, torch.nn.Parameter]]] = [[] for _ in range(len(blocks) + 1)]
        for name, param in named_parameters:
            self.units[unit_of.get(id(param), 0)].append((name, param))
        self.owned = [[(n, p) for n, p in unit if owner_of[n] == place] for unit in self.units]
        self.home = torch.device("cpu") if offload else self.device  # where anchors and outer momentum live
        pin = offload and self.device.type == "cuda"

        def anchor(p: torch.Tensor) -> torch.nn.Parameter:
            copy = local(p.detach()).float().to(self.home, copy=True)
            return torch.nn.Parameter(copy.pin_memory() if pin else copy)

        with torch.no_grad():
            self.anchors = {n: anchor(p) for u in self.owned for n, p in u}
        self.outers = [
            torch.optim.SGD([self.anchors[n] for n, _ in unit], **outer) if unit else None for unit in self.owned
        ]
        self.inflight: dict[int, tuple[object, torch.Tensor | None, bool]] = {}
        # A-EDiT's step weighting (parallel.local_sgd.step_weight): each worker's share of the steps taken since
        # the last sync, set before each sync; None: off
        self.shares: list[float] | None = None
        self.share_ratio = 0.0
        self.next_unit = len(self.units)  # the unit the pending sync applies next (len: none pending)
        self.applied = False  # set when a unit's new parameters are written (the engine clears it)
        if layerwise:  # prepended: before FSDP2's own pre-forward hook gathers the unit's new shards
            model.register_forward_pre_hook(lambda module, args: self._before(0), prepend=True)
            for index, block in enumerate(blocks):
                block.register_forward_pre_hook(lambda module, args, unit=index + 1: self._before(unit), prepend=True)

    # -------------------------------------------------------------------- state
    def set_anchors(self) -> None:
        with torch.no_grad():
            for unit in self.owned:
                for name, param in unit:
                    self.anchors[name].copy_(local(param))

    def momentum_buffers(self) -> dict[str, torch.Tensor]:
        """The outer momentum of each owned parameter (created at zero: torch SGD's first step then gives the
        same as its own first step, dampening 0); empty without momentum."""
        buffers = {}
        for unit, outer in zip(self.owned, self.outers, strict=True):
            if outer is None or not outer.defaults["momentum"]:
                continue
            for name, _ in unit:
                entry = outer.state[self.anchors[name]]
                if entry.get("momentum_buffer") is None:
                    entry["momentum_buffer"] = torch.zeros_like(self.anchors[name])
                buffers[name] = entry["momentum_buffer"]
        return buffers

    @contextlib.contextmanager
    def anchored(self):
        """The last synced model in the parameters for the duration (validation evaluates it): each owned
        parameter takes its anchor, the rest of a worker gets them from their owners (DDP inside a worker);
        every parameter is restored after, bit for bit. Costs one copy of this process's parameters."""
        params = [(n, p) for unit in self.units for n, p in unit]
        with torch.no_grad():
            saved = {n: local(p.detach()).clone() for n, p in params}
            for unit in self.owned:
                for name, param in unit:
                    local(param).copy_(self.anchors[name])
            if self.shard > 1 and not self.sharded:
                for work in [
                    dist.broadcast(p.data, self.first + self.owner_of[n], group=self.worker_group, async_op=True)
                    for n, p in params
                ]:
                    work.wait()
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in params:
                    local(param).copy_(saved[name])

    # --------------------------------------------------------------- the sync
    def sync_now(self) -> None:
        """Every unit: all reductions in flight, then applied in order."""
        for unit in range(len(self.units)):
            self._launch(unit)
        for unit in range(len(self.units)):
            self._apply(unit)

    def sync_voted(self, reduce, commit) -> bool:
        """Every unit, its pseudo-gradients summed by ``reduce`` (flat tensor -> a work to wait on: a fault-tolerant
        all-reduce over the replica groups, train/fault_tolerance/workers.py) and applied only if ``commit()``
        after every reduction ended; otherwise nothing changes (the sync is taken again)."""
        reductions = {}
        for unit in range(len(self.units)):
            self._launch(unit, reduce)
            reductions[unit] = self.inflight[unit]
        for work, _, _ in reductions.values():
            if work is not None:
                work.wait()
        self.inflight.clear()
        if not commit():
            return False
        for unit, (_, flat, rollback) in reductions.items():
            self.inflight[unit] = (None, flat, rollback)
            self._apply(unit)
        return True

    def sync_in_next_forward(self) -> None:
        self.next_unit = 0

    def finish(self) -> None:
        """Apply what a pending layer-wise sync has not yet (before a checkpoint, at the end)."""
        while self.next_unit < len(self.units):
            self._launch(self.next_unit)
            self._apply(self.next_unit)
            self.next_unit += 1

    def _before(self, unit: int) -> None:
        if self.next_unit != unit:  # no sync pending for this unit (later microbatches, recompute)
            return
        self._launch(unit)
        if unit + 1 < len(self.units):
            self._launch(unit + 1)  # prefetch: in flight while this unit computes
        self._apply(unit)
        self.next_unit = unit + 1

    def _launch(self, unit: int, reduce=None) -> None:
        """Start unit ``unit``'s reduction: the mean pseudo-gradient, or (penalty) the weighted sum of the
        workers' pseudo-gradients once every process knows every worker's norm."""
        if unit in self.inflight:
            return
        owned = self.owned[unit]
        flat = None
        with torch.no_grad():
            if owned:
                flat = torch.cat(
                    [
                        (self.anchors[n].to(self.device, non_blocking=True) - local(p.detach()).float()).reshape(-1)
                        for n, p in owned
                    ]
                )
        rollback = False
        if self.penalty is not None or self.shares is not None:
            weights = self._weigh(unit, flat) if self.penalty is not None else [1.0 / self.workers] * self.workers
            rollback = not any(weights)
            weights = mix_weights(weights, self.shares, self.share_ratio)
            if flat is not None:
                flat.mul_(weights[self.worker])
        work = None
        if flat is not None and reduce is not None:
            work = reduce(flat)
        elif flat is not None and self.workers > 1:
            work = dist.all_reduce(flat, group=self.sync_group, async_op=True)
        self.inflight[unit] = (work, flat, rollback)

    def _weigh(self, unit: int, flat: torch.Tensor | None) -> list[float]:
        """Every worker's pseudo-gradient norm over the whole unit (a sum inside the worker, then gathered over
        the sync group), judged by the penalty; the verdict is recorded."""
        square = self._worker_square(flat)
        norms = [square]
        if self.workers > 1:
            norms = [torch.zeros_like(square) for _ in range(self.workers)]
            dist.all_gather(norms, square, group=self.sync_group)
        values = [float(n.sqrt()) for n in norms]  # a host read, once per unit and sync (not per step)
        weights, flags = self.penalty.verdict(unit, values)
        self.verdicts.append({"unit": unit, "norms": values, "anomalous": flags, "weights": weights})
        return weights

    def _worker_square(self, flat: torch.Tensor | None) -> torch.Tensor:
        """The squared norm of a unit's vector over the whole worker (each process holds its owned part)."""
        square = torch.zeros(1, dtype=torch.float64, device=self.device)
        if flat is not None:
            square += flat.double().square().sum()
        if self.shard > 1:
            dist.all_reduce(square, group=self.worker_group)
        return square

    def _apply(self, unit: int) -> None:
        self.applied = True
        owned = self.owned[unit]
        work, flat, rollback = self.inflight.pop(unit, (None, None, False))
        with torch.no_grad():
            if work is not None:
                work.wait()
            if self.penalty is None and self.shares is None:
                if flat is not None:
                    flat.div_(self.workers)  # the mean pseudo-gradient
            elif (
                self.penalty is not None and self.penalty.cfg.clip is not None
            ):  # the combined pseudo-gradient's norm over the whole unit
                square = self._worker_square(flat)
                scale = min(1.0, float(self.penalty.cfg.clip) / (float(square.sqrt()) + 1e-6))
                if flat is not None:
                    flat.mul_(scale)
            if owned:
                if not rollback:  # every worker anomalous: no outer step, the anchor comes back
                    flat = flat.to(self.home)  # offload: the outer step runs where the anchors are
                    offset = 0
                    for name, _ in owned:
                        anchor = self.anchors[name]
                        anchor.grad = flat[offset : offset + anchor.numel()].view_as(anchor)
                        offset += anchor.numel()
                    self.outers[unit].step()
                    self.outers[unit].zero_grad(set_to_none=True)
                for name, param in owned:
                    local(param).copy_(self.anchors[name])
            if self.shard > 1 and not self.sharded:  # every owner's new parameters to the rest of its worker
                works = [
                    dist.broadcast(p.data, self.first + self.owner_of[n], group=self.worker_group, async_op=True)
                    for n, p in self.units[unit]
                ]
                for work in works:
                    work.wait()


def mix_weights(weights: list[float], shares: list[float] | None, ratio: float) -> list[float]:
    """A-EDiT's step weighting: each worker's weight becomes (1 - ratio) x its weight + ratio x its share of the
    steps taken since the last sync, over the workers whose weight is not zero (anomalous ones stay out), then
    renormalized to sum 1. Without shares (or all weights zero: a rollback) the weights are returned as they
    are."""
    if shares is None or not any(weights):
        return weights
    mixed = [(1.0 - ratio) * w + ratio * s if w > 0 else 0.0 for w, s in zip(weights, shares, strict=True)]
    total = sum(mixed)
    if total <= 0:  # every normal worker took no step: fall back to the weights alone
        return weights
    return [m / total for m in mixed]
