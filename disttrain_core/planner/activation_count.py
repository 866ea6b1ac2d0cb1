"""Activation bytes counted on real modules (the U-Net's accounting, where no formula serves): what autograd
saves for backward, what each recompute policy keeps (the runtime's own wrappers applied), and the largest
block's saved bytes -- measured with saved-tensor hooks on meta or small inputs (planner/workload.py reads
them into the generator's ``UnitWork``)."""

from __future__ import annotations


def counted_saved_bytes(module, inputs) -> float:
    """Bytes of activations autograd saves for backward in one forward.

    Each tensor counts once however often it is saved (views of one tensor share it), and
    parameters and views of parameters are not activations. Works on the meta device too."""
    import torch

    seen: dict = {}  # holding references keeps ids unique during the forward

    def pack(tensor):
        if isinstance(tensor, torch.Tensor):
            base = tensor._base if tensor._base is not None else tensor
            if not isinstance(base, torch.nn.Parameter):
                key = id(base) if tensor.device.type == "meta" else tensor.untyped_storage().data_ptr()
                seen.setdefault(key, base)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return float(sum(t.numel() * t.element_size() for t in seen.values()))


def counted_kept_bytes(make_module, inputs, policy: str) -> float:
    """Bytes a module keeps for backward under a recompute policy, counted on meta with the runtime's own
    wrappers (parallel/recompute.py): what autograd saves outside recomputed blocks, plus each recomputed
    block's inputs (its checkpoint holds them), plus under selective_op the outputs the policy keeps."""
    import torch

    from ..parallel.recompute import _SAVED, BLOCKS, apply_recompute
    from ..torch_compat import TorchDispatchMode

    module = make_module()
    apply_recompute(module, policy, every=1)
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

    for block in module.modules():
        if getattr(block, "_recompute", False) and isinstance(block, BLOCKS):
            block.register_forward_pre_hook(enter)
            block.register_forward_hook(leave)

    def pack(tensor):
        keep(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if policy == "selective_op":
            with KeptOutputs():
                module(*inputs)
        else:
            module(*inputs)
    return float(sum(t.numel() * t.element_size() for t in seen.values()))


def largest_block_bytes(module, inputs) -> float:
    """The most bytes any one recomputable block saves for backward (what it holds again while its
    recomputation and backward run), counted on meta."""
    import torch

    from ..parallel.recompute import BLOCKS

    current: list = []
    per_block: dict[int, dict] = {}

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
        if current and isinstance(tensor, torch.Tensor) and not isinstance(tensor, torch.nn.Parameter):
            base = tensor._base if tensor._base is not None else tensor
            if not isinstance(base, torch.nn.Parameter):
                per_block[current[-1]].setdefault(id(base), base)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    for handle in handles:
        handle.remove()
    return max((sum(t.numel() * t.element_size() for t in saved.values()) for saved in per_block.values()), default=0.0)
