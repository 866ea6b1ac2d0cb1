"""Activation bytes counted on real modules (the U-Net's accounting, where no formula serves): what autograd
saves for backward, what each recompute policy keeps (the runtime's own wrappers applied), and the largest
block's saved bytes -- measured with saved-tensor hooks on meta or small inputs (planner/workload.py reads
them into the generator's ``UnitWork``)."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext


def _storage_key(tensor, base) -> int:
    """What identifies a tensor's memory: its storage's address, or (meta and fake tensors, which have none)
    the Python object of its base."""
    from torch._subclasses.fake_tensor import FakeTensor

    if tensor.device.type == "meta" or isinstance(tensor, FakeTensor):
        return id(base)
    return tensor.untyped_storage().data_ptr()


def counted_saved_bytes(module, inputs) -> float:
    """Bytes of activations autograd saves for backward in one forward.

    Each tensor counts once however often it is saved (views of one tensor share it), and
    parameters and views of parameters are not activations; a DTensor counts its local part. Works on the meta
    device too."""
    import torch

    seen: dict = {}  # holding references keeps ids unique during the forward

    def pack(tensor):
        if isinstance(tensor, torch.Tensor):
            base = tensor._base if tensor._base is not None else tensor
            if not isinstance(base, torch.nn.Parameter):
                base = getattr(base, "_local_tensor", base)  # a DTensor: this rank's bytes
                seen.setdefault(_storage_key(base, base), base)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return float(sum(t.numel() * t.element_size() for t in seen.values()))


def counted_kept_bytes(module, inputs, policy: str) -> float:
    """Bytes a module keeps for backward under a recompute policy, counted on meta with the runtime's own
    wrappers (parallel/recompute.py, applied to ``module`` by the caller: ``apply_recompute(module, policy,
    every=1)``): what autograd saves outside recomputed blocks, plus each recomputed block's inputs (its
    checkpoint holds them), plus under selective_op the outputs the policy keeps. The module is left as it
    came (its hooks removed), so one module serves several counts."""
    import torch

    from ..base.torch_compat import TorchDispatchMode
    from ..parallel.recompute import _SAVED, BLOCKS

    seen: dict = {}
    inside = [0]

    def keep(tensor) -> None:
        if isinstance(tensor, torch.Tensor) and not isinstance(tensor, torch.nn.Parameter):
            base = tensor._base if tensor._base is not None else tensor
            if not isinstance(base, torch.nn.Parameter):
                seen.setdefault(id(base), base)

    def enter(block, args):
        inside[0] += 1
        for arg in args:
            keep(arg)

    def leave(block, args, out):
        inside[0] -= 1

    class KeptOutputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if inside[0] and getattr(func, "overloadpacket", None) in _SAVED:
                for tensor in out if isinstance(out, tuple) else (out,):
                    keep(tensor)
            return out

    handles = []
    for block in module.modules():
        if getattr(block, "_recompute", False) and isinstance(block, BLOCKS):
            handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]

    def pack(tensor):
        keep(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if policy == "selective_op":
            with KeptOutputs():
                module(*inputs)
        else:
            module(*inputs)
    for handle in handles:
        handle.remove()
    return float(sum(t.numel() * t.element_size() for t in seen.values()))


def saved_and_largest_block_bytes(module, inputs) -> tuple[float, float]:
    """Two counts from one forward: what autograd saves for backward (:func:`counted_saved_bytes`), and the
    most bytes any one recomputable block saves (what it holds again while its recomputation and backward
    run), counted on meta."""
    import torch

    from ..parallel.recompute import BLOCKS

    current: list = []
    per_block: dict[int, dict] = {}
    seen: dict = {}

    def enter(block, args):
        current.append(id(block))
        per_block.setdefault(id(block), {})

    def leave(block, args, out):
        current.pop()

    handles = []
    for block in module.modules():
        if isinstance(block, BLOCKS):
            handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]

    def pack(tensor):
        if isinstance(tensor, torch.Tensor):
            base = tensor._base if tensor._base is not None else tensor
            if not isinstance(base, torch.nn.Parameter):
                if current:
                    per_block[current[-1]].setdefault(id(base), base)
                local = getattr(base, "_local_tensor", base)  # a DTensor: this rank's bytes
                seen.setdefault(_storage_key(local, local), local)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    for handle in handles:
        handle.remove()
    largest = max((sum(t.numel() * t.element_size() for t in b.values()) for b in per_block.values()), default=0.0)
    return float(sum(t.numel() * t.element_size() for t in seen.values())), largest


# CUDA autocast runs these in fp32 whatever their input; CPU autocast runs them in their input's dtype. Under
# bf16 autocast an input already in bf16 (a convolution's output in the U-Net) therefore makes CUDA save an fp32
# copy of it and an fp32 output where the CPU keeps bf16.
CUDA_FP32_FUNCTIONS = ("group_norm", "layer_norm", "softmax", "log_softmax")


@contextmanager
def cuda_autocast_policy():
    """Inside CPU autocast, run the functions CUDA autocast keeps in fp32 in fp32 too (torch.nn.functional's, which
    the modules call), so that a count on the CPU is what a CUDA step saves."""
    import torch
    import torch.nn.functional as F

    originals = {name: getattr(F, name) for name in CUDA_FP32_FUNCTIONS}

    def upcast(original):
        def call(input, *args, **kwargs):
            if torch.is_autocast_enabled("cpu") and input.dtype in (torch.bfloat16, torch.float16):
                input = input.float()
                with torch.autocast("cpu", enabled=False):
                    args = tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
                    return original(input, *args, **kwargs)
            return original(input, *args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(F, name, upcast(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(F, name, original)


def saved_bytes_per_item(
    make_module, make_inputs, mixed: bool = False, policy: str | None = None, device: str = "cuda"
) -> float:
    """Bytes autograd saves per item (batch of 2 minus batch of 1: weight copies and per-call constants drop
    out) for a module built by ``make_module()`` on inputs ``make_inputs(batch)``, on fake CPU tensors (no
    memory is allocated; the CPU kernels are chosen as for real ones: flash attention saves no scores, where
    the meta device's math attention would). ``mixed``: under CPU bf16 autocast (it applies to fake tensors
    as to real ones) with ``device``'s autocast policy (cuda: :func:`cuda_autocast_policy`; cpu: CPU autocast's
    own). ``policy``: what that recompute policy keeps (:func:`counted_kept_bytes`)."""
    from ..parallel.recompute import apply_recompute

    with _fake_counting(mixed, device):
        module = make_module()  # one module for both batches: building SD's U-Net costs as much as a forward
        if policy is None:
            return saved_and_largest_per_item(module, make_inputs)[0]
        apply_recompute(module, policy, every=1)
        return counted_kept_bytes(module, make_inputs(2), policy) - counted_kept_bytes(module, make_inputs(1), policy)


def saved_and_largest_per_item(module, make_inputs) -> tuple[float, float]:
    """Per item (batch of 2 minus batch of 1), from one forward per batch: the bytes autograd saves and the
    largest recomputable block's (:func:`saved_and_largest_block_bytes`). Call it inside ``_fake_counting``."""
    two, one = (saved_and_largest_block_bytes(module, make_inputs(batch)) for batch in (2, 1))
    return two[0] - one[0], two[1] - one[1]


@contextmanager
def _fake_counting(mixed: bool, device: str):
    """Fake CPU tensors, under bf16 autocast with ``device``'s policy when ``mixed`` (saved_bytes_per_item)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    rules = cuda_autocast_policy() if mixed and device == "cuda" else nullcontext()
    with FakeTensorMode(), torch.device("cpu"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed), rules:
        yield


def unet_activation_counts(
    cfg, grid: tuple[int, int], mixed: bool, device: str = "cuda", unet_cfg=None
) -> tuple[float, dict[str, float]]:
    """A U-Net (model config ``cfg``'s generator, or ``unet_cfg``; latents of ``grid``): bytes saved per item
    without recompute, and (full, selective_op, largest_block) what recompute keeps and reruns
    (planner/workload.py); ``mixed``: under bf16 autocast with ``device``'s policy."""
    import torch

    from ..models.unet import UNet

    g = cfg.generator if unet_cfg is None else unet_cfg

    def make():
        return UNet(g).requires_grad_(True)

    def inputs(batch: int):
        latents = torch.empty(batch, g.in_channels, *grid)
        context = torch.empty(batch, cfg.gen_tokens, g.cross_attention_dim, requires_grad=True)
        return latents, torch.zeros(batch, dtype=torch.long), context

    with _fake_counting(mixed, device):
        saved, largest = saved_and_largest_per_item(make(), inputs)
    kept = {p: saved_bytes_per_item(make, inputs, mixed, p, device) for p in ("full", "selective_op")}
    return saved, {**kept, "largest_block": largest}


class LiveTensorBytes:
    """``with LiveTensorBytes(baseline) as live: ...`` -- the peak bytes of tensors alive inside the block:
    ``baseline`` (what the caller holds on entry, e.g. the inputs) plus every storage an operator creates
    there, counted from its creation until the storage is freed (whoever held it: a Python name, a view, the
    autograd graph). Kernels' private scratch is not visible to it; op outputs, temporaries and receive
    buffers are. Runs in this thread only (dispatch modes are thread-local)."""

    def __init__(self, baseline: float = 0.0):
        self.live = self.peak = float(baseline)
        self._mode = None

    def _created(self, storage) -> None:
        import weakref

        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, storage.nbytes())

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __enter__(self) -> LiveTensorBytes:
        import weakref

        import torch
        from torch.utils._pytree import tree_leaves

        from ..base.torch_compat import TorchDispatchMode

        counter = self
        known: set[int] = set()  # storages counted and still alive (the allocator may reuse a freed address)

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                inputs = {
                    t.untyped_storage().data_ptr()
                    for t in tree_leaves((args, kwargs or {}))
                    if isinstance(t, torch.Tensor)
                }
                out = func(*args, **(kwargs or {}))
                for tensor in tree_leaves(out):
                    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                        continue
                    storage = tensor.untyped_storage()
                    pointer = storage.data_ptr()
                    if pointer and pointer not in inputs and pointer not in known and storage.nbytes():
                        known.add(pointer)
                        counter._created(storage)
                        weakref.finalize(storage, known.discard, pointer)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
