"""Bucketed collectives that run beside the computation (the StepCCL idea).

``BucketedSync`` moves ZeRO-1's two kinds of traffic off the critical path:

* **gradients.** A post-accumulate-grad hook on every parameter counts the
  gradients of the *last* microbatch as autograd produces them; when a bucket is
  complete its gradients are copied into the bucket's flat buffer and an
  asynchronous reduce-scatter is issued over the data-parallel group while
  autograd keeps computing the earlier layers. Earlier microbatches only
  accumulate (no communication). ``finish_grads`` issues whatever is left
  (parameters that got no gradient in the last microbatch), waits, and hands
  the reduced shard to the optimizer.
* **parameters.** After the optimizer step every bucket's updated slice is
  all-gathered asynchronously, in forward order; a forward pre-hook on each
  module waits only for the buckets holding that module's parameters, so layer
  ``k + 1``'s gather is in flight while layer ``k`` computes.

With overlap switched off the same buckets are reduced after backward and
gathered right after the step, synchronously: the arithmetic is identical, only
the timing changes. The collectives themselves (``parallel.comm.collectives``)
are NCCL's own on its communication stream, or on gloo point-to-point rings
driven by a background thread over a process group of their own (comm/ring.py).

``skip_collectives`` (benchmarks only) replaces every collective with the local
copy it would have produced on one replica, to time the computation alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from .buckets import FlatBuckets
from .partial_grads import PartialGradients
from .trace import CommTrace

Key = tuple[str, int]  # (flat buffer name, bucket index)

# ``parallel.comm.interleave_modes``: the switches each benchmark mode sets.
MODES = {
    "overlap": {"overlap_grad_reduce": True, "overlap_param_gather": True, "skip_collectives": False},
    "no_overlap": {"overlap_grad_reduce": False, "overlap_param_gather": False, "skip_collectives": False},
    "compute_only": {"overlap_grad_reduce": True, "overlap_param_gather": True, "skip_collectives": True},
}


def interleaved_mode(modes: list[str], block: int, step: int) -> str:
    """The mode of (1-based) ``step`` when ``modes`` take turns in blocks of ``block`` steps."""
    return modes[((step - 1) // block) % len(modes)]


class BucketedSync:
    def __init__(
        self,
        flats: dict[str, FlatBuckets],
        collectives,
        dp: int,
        *,
        overlap_grad_reduce: bool,
        overlap_param_gather: bool,
        skip_collectives: bool = False,
        stage_of: dict[int, int] | None = None,
        partial_grads: PartialGradients | None = None,
        tp_group=None,
        trace: CommTrace | None = None,
        order: list[nn.Parameter] | None = None,
        order_group=None,
        gather_dtype: torch.dtype = torch.float32,
    ):
        self.flats, self.collectives, self.dp = flats, collectives, dp
        self.overlap_grad, self.overlap_param = overlap_grad_reduce, overlap_param_gather
        self.skip = skip_collectives
        self.trace = trace
        self.stage_of = stage_of or {}
        self.partial = partial_grads or PartialGradients()  # sequence-parallel: summed over the TP group first
        self.tp_group = tp_group
        # Gradients accumulate in place in ``grad_flat`` (the parameters' .grad are views of it) and the
        # reduce-scatter lands in this replica's slice, which is the masters' gradient. Updated parameters
        # travel in ``gather_dtype``: in fp32 the all-gather lands in ``param_flat``, of which the
        # parameters are views; in bf16 (under bf16-mixed: half the bytes) into a bf16 buffer whose slices
        # are copied into the parameters, which then hold bf16-rounded values while the fp32 masters stay
        # in the optimizer.
        self.gather_dtype = gather_dtype
        self.grad_flat = {n: torch.zeros(f.padded, dtype=torch.float32, device=f.device) for n, f in flats.items()}
        self.param_flat = {n: f.gather_params().to(gather_dtype) for n, f in flats.items()}
        self.params_are_views = gather_dtype == torch.float32
        for name, flat in flats.items():
            flat.bind(self.param_flat[name] if self.params_are_views else None, self.grad_flat[name])
        self.where: dict[int, Key] = {}  # id(param) -> (flat buffer name, bucket index)
        for name, flat in flats.items():
            for index, (_, param) in enumerate(flat.params):
                self.where[id(param)] = (name, flat.bucket_of[index])
        self.sizes = {(n, b.index): len(b.members) for n, f in flats.items() for b in f.buckets}
        # Parameter gathers are issued in the order the forward first needs a bucket: by the earliest
        # definition position (``order``) of its parameters across all flat buffers, so a small buffer
        # every layer uses (the norm weights) is not gathered after all the others.
        position = {id(p): i for i, p in enumerate(order or [])}

        def first_use(key: Key) -> tuple:
            flat = flats[key[0]]
            members = flat.buckets[key[1]].members
            earliest = min((position.get(id(flat.params[m][1]), 0) for m in members), default=0)
            return (earliest, list(flats).index(key[0]), -key[1])

        self.gather_order = sorted(self.sizes, key=first_use)
        # Reduce-scatters are issued strictly in this order, a bucket only once every bucket before it
        # is out -- the same sequence on every replica even when a replica gets no gradient for some
        # parameter in its last microbatch (a replica without images that microbatch): otherwise the
        # rings would pair different buckets. The first step uses the reverse of the gather order;
        # after it, the order in which buckets actually completed on the first replica is broadcast
        # and used from then on (DDP's rebuilt buckets): an order that differs from autograd's would
        # hold finished buckets back behind one that completes late.
        self.reduce_order = list(reversed(self.gather_order))
        self.order_group = order_group
        self.completed: list[Key] | None = [] if overlap_grad_reduce else None  # recording, first step only
        self._reset_grads()
        self.param_works: dict[Key, object] = {}
        self.hooks = []
        for flat in flats.values():  # they act only while overlap_grad is on (set_mode may switch it)
            for _, param in flat.params:
                self.hooks.append(param.register_post_accumulate_grad_hook(self._on_grad))

    def set_mode(self, overlap_grad_reduce: bool, overlap_param_gather: bool, skip_collectives: bool) -> None:
        """Switch the overlap and skip switches between two steps (benchmarks interleave modes in a run).
        Results never depend on the first two; skipping collectives trains a wrong model."""
        if self.grad_works or self.next_reduce:
            raise RuntimeError("BucketedSync.set_mode: gradient buckets of this step are in flight")
        self.overlap_grad, self.overlap_param = overlap_grad_reduce, overlap_param_gather
        self.skip = skip_collectives

    # ------------------------------------------------------------- gradients
    def _reset_grads(self) -> None:
        self.armed: set[int] = set()
        self.ready: set[int] = set()
        self.remaining = dict(self.sizes)
        self.grad_works: dict[Key, object] = {}
        self.next_reduce = 0  # position in reduce_order of the next bucket to issue

    def zero_grads(self) -> None:
        """Zero the gradient buffers (the parameters' .grad are views of them: never set to None)."""
        for grad in self.grad_flat.values():
            grad.zero_()

    def begin_step(self) -> None:
        """A step begins (FSDP2's pipeline sync acts here: parallel/fsdp.py; the buckets need nothing)."""

    def arm(self, stage: int = 0) -> None:
        """The next backward of ``stage`` is its last in this step: reduce its buckets as they complete."""
        self.armed.add(stage)

    def _on_grad(self, param: nn.Parameter) -> None:
        if self.overlap_grad and self.stage_of.get(id(param), 0) in self.armed:
            self._ready(param)

    def grads_ready(self, params: Iterable[nn.Parameter]) -> None:
        """Gradients accumulated outside autograd's hooks (the pipeline's deferred weight backward)."""
        if self.overlap_grad:
            for param in params:
                if id(param) in self.where and self.stage_of.get(id(param), 0) in self.armed:
                    self._ready(param)

    def _ready(self, param: nn.Parameter) -> None:
        if id(param) in self.ready:
            return
        self.ready.add(id(param))
        name, bucket = self.where[id(param)]
        self.remaining[(name, bucket)] -= 1
        if self.completed is not None and not self.remaining[(name, bucket)]:
            self.completed.append((name, bucket))
        while self.next_reduce < len(self.reduce_order):
            key = self.reduce_order[self.next_reduce]
            if self.remaining[key]:
                break
            self._reduce(key, async_op=True)
            self.next_reduce += 1

    def _reduce(self, key: Key, async_op: bool) -> None:
        name, index = key
        flat, bucket = self.flats[name], self.flats[name].buckets[index]
        for member in bucket.members:
            param = flat.params[member][1]
            if not self.skip:
                self.partial.complete(param)
        source = bucket.full(self.grad_flat[name])
        target = bucket.slice_of(self.grad_flat[name], flat.rank)  # in place: the masters' gradient
        issued = self.trace.now() if self.trace is not None else None
        if self.dp == 1 or self.skip:  # this replica's own sums are already there
            work = None
        else:
            work = self.collectives.reduce_scatter(target, source, async_op=async_op)
        self.grad_works[key] = work
        if self.trace is not None:
            self.trace.comm(f"reduce-scatter {name}[{index}]", issued, work, bucket.padded * source.element_size())

    def finish_grads(self) -> None:
        """Reduce every bucket not reduced yet, wait for all, and give the optimizer its gradient shards."""
        for key in self.reduce_order[self.next_reduce :]:
            self._reduce(key, async_op=False)
        started = self.trace.now() if self.trace is not None else None
        for work in self.grad_works.values():
            if work is not None:
                work.wait()
        if self.trace is not None:
            self.trace.compute("wait: gradients", started, self.trace.now())
        if self.completed is not None:
            self._adopt_recorded_order()
        self._reset_grads()

    def _adopt_recorded_order(self) -> None:
        """Issue future reduce-scatters in the order buckets completed in this (first) step on the first
        replica; buckets that got no gradient in the last microbatch keep their place at the end."""
        done = set(self.completed)
        recorded = self.completed + [key for key in self.reduce_order if key not in done]
        self.completed = None
        keys = sorted(self.sizes)  # the same numbering on every replica
        number = {key: i for i, key in enumerate(keys)}
        order = torch.tensor([number[key] for key in recorded], dtype=torch.int64)
        if self.dp > 1 and self.order_group is not None:  # also when skipping: a later mode may not skip
            order = order.to(next(iter(self.flats.values())).device)
            dist.broadcast(order, src=dist.get_global_rank(self.order_group, 0), group=self.order_group)
        self.reduce_order = [keys[i] for i in order.tolist()]

    # ------------------------------------------------------------ parameters
    def gather_params(self) -> None:
        """All-gather every bucket's updated slice; asynchronously when parameter-gather overlap is on."""
        self.wait_params()
        for key in self.gather_order:  # forward order: first layers first
            name, index = key
            flat, bucket = self.flats[name], self.flats[name].buckets[index]
            own = bucket.slice_of(self.param_flat[name], flat.rank)
            with torch.no_grad():
                own.copy_(flat.masters[index].detach())  # casts to bf16 on a bf16 wire
            issued = self.trace.now() if self.trace is not None else None
            if self.dp == 1 or self.skip:
                work = None
            else:  # in place: this replica's slice is already where the gather puts it
                work = self.collectives.all_gather(bucket.full(self.param_flat[name]), own, self.overlap_param)
            if self.trace is not None:
                nbytes = bucket.padded * own.element_size()
                self.trace.comm(f"all-gather {name}[{index}]", issued, work, nbytes)
            self.param_works[key] = work
        if not self.overlap_param:
            self.wait_params()

    def wait_params(self, keys: Iterable[Key] | None = None) -> None:
        """Finish the pending gathers of ``keys`` (all by default) and write them into the parameters."""
        if not self.param_works:
            return
        started, stamp = time.perf_counter(), self.trace.now() if self.trace is not None else None
        for key in list(self.param_works) if keys is None else keys:
            work = self.param_works.pop(key, False)
            if work is False:
                continue
            if work is not None:
                work.wait()
            if not self.params_are_views:
                name, index = key
                self.flats[name].write_back(self.flats[name].buckets[index], self.param_flat[name])
        if self.trace is not None and time.perf_counter() - started > 1e-4:
            self.trace.compute("wait: parameters", stamp, self.trace.now())

    def install_forward_hooks(self, roots: Iterable[nn.Module], atomic: tuple[type, ...] = ()) -> None:
        """Wait for a module's parameter buckets just before it runs.

        Every module directly owning parameters gets a pre-hook for them. Modules of an ``atomic`` type
        (blocks whose forward may use their children's weights without calling the children) wait for
        their whole subtree. A parameter whose owner has children and is not inside an atomic block may
        be used by a method other than ``forward``: it is waited for when its root module starts.
        """
        for root in roots:
            early: set[Key] = set()
            self._hook_subtree(root, atomic, early, inside_atomic=False)
            if early:
                self.hooks.append(root.register_forward_pre_hook(self._waiter(early)))

    def _keys(self, params: Iterable[nn.Parameter]) -> set[Key]:
        return {self.where[id(p)] for p in params if id(p) in self.where}

    def _waiter(self, keys: set[Key]):
        ordered = sorted(keys)

        def hook(_module, _args):
            if self.param_works:
                self.wait_params(ordered)

        return hook

    def _hook_subtree(self, module: nn.Module, atomic, early: set[Key], inside_atomic: bool) -> None:
        is_atomic = isinstance(module, atomic)
        if is_atomic and not inside_atomic:
            keys = self._keys(module.parameters())
            if keys:
                self.hooks.append(module.register_forward_pre_hook(self._waiter(keys)))
        own = self._keys(module.parameters(recurse=False))
        if own and not (inside_atomic or is_atomic):
            if any(True for _ in module.children()):
                early |= own
            else:
                self.hooks.append(module.register_forward_pre_hook(self._waiter(own)))
        for child in module.children():
            self._hook_subtree(child, atomic, early, inside_atomic or is_atomic)

    def close(self) -> None:
        self.wait_params()
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        if self.collectives is not None:
            self.collectives.close()


def make_collectives(kind: str, group, dp: int, dedicated_group=None):
    """``ring``: point-to-point rings on a background thread (comm/ring.py) over ``dedicated_group``
    (no other thread may use it); ``native``: ``group``'s own collectives; ``auto``: ring on gloo,
    native on NCCL and others. Without a dedicated group the ring falls back to native: two threads
    issuing on one process group could interleave differently on different ranks."""
    from .ring import NativeCollectives, RingCollectives

    if dp == 1 or group is None:
        return None
    if kind == "auto":
        kind = "ring" if dist.get_backend(group) == "gloo" else "native"
    if kind == "ring" and dedicated_group is not None:
        return RingCollectives(dedicated_group)
    if kind == "ring":
        return NativeCollectives(group)
    if kind == "native":
        return NativeCollectives(group)
    raise ValueError(f"parallel.comm.collectives={kind!r}: allowed values are auto, ring and native")


def allreduce_gradients(params: list[nn.Parameter], group, bucket_numel: float, world: int) -> None:
    """Average ``params``' gradients over ``group`` in flat buckets, synchronously (DDP without overlap)."""
    allreduce_tensors([p.grad for p in params if p.grad is not None], group, bucket_numel, world)


def allreduce_tensors(grads: list[torch.Tensor], group, bucket_numel: float, world: int) -> None:
    """Average ``grads`` over ``group`` in place, in flat buckets of about ``bucket_numel`` elements."""
    bucket: list[torch.Tensor] = []
    count = 0

    def flush() -> None:
        nonlocal bucket, count
        if bucket:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        bucket, count = [], 0

    for grad in reversed(grads):
        bucket.append(grad)
        count += grad.numel()
        if count >= bucket_numel:
            flush()
    flush()
