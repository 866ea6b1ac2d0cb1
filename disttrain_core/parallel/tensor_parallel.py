"""Tensor parallelism applied from outside the model, with DTensor plans.

Megatron's pattern on every transformer block: the q/k/v (and the MLP's first)
projections are column-parallel (each rank holds a slice of the heads / hidden
units), the output projections are row-parallel (partial results are summed with
one all-reduce). Blocks take and return ordinary, replicated tensors, so nothing
else in the model changes; the attention code already derives its local head
count from the tensor shapes.

Where TP applies: Llama decoder blocks (dense or MoE), ViT blocks, the U-Net's transformers, and the Llama's
vocabulary: the token embedding is
row-parallel (each rank holds V/tp rows, looks up the tokens it holds, one all-reduce sums the lookups) and the
output head holds V/tp rows too, its loss computed without gathering the logits (models/vocab_parallel.py).
A MoE block's attention takes the Llama plan; its experts and shared experts each split their hidden width over
the group (models/moe.py runs them on the local slices and sums the partial outputs once per layer).
In the U-Net every spatial transformer's self- and cross-attention split their heads and the GEGLU feed-forward
its hidden width (the same column / row pattern); its residual blocks, resamplers, GroupNorms and the
transformers' proj_in / proj_out stay replicated inside the TP group, as do the norms outside the blocks and
the projectors (every TP rank computes them whole).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..comm.sequence_split import SequenceSplit
from ..models.audio import AudioEncoder
from ..models.llama import DecoderBlock, Llama
from ..models.moe import MoeFeedForward
from ..models.unet import SpatialTransformer
from ..models.vit import VisionTransformer, VitBlock

LLAMA_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}
UNET_TRANSFORMER_PLAN = {
    **{f"{attn}.{name}": ColwiseParallel() for attn in ("attn1", "attn2") for name in ("to_q", "to_k", "to_v")},
    "attn1.to_out": RowwiseParallel(),
    "attn2.to_out": RowwiseParallel(),
    "ff.proj": ColwiseParallel(),
    "ff.gate": ColwiseParallel(),
    "ff.out": RowwiseParallel(),
}
ATTENTION_PLAN = {name: style for name, style in LLAMA_PLAN.items() if name.startswith("attention.")}
VIT_PLAN = {
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.proj": RowwiseParallel(),
    "mlp.fc1": ColwiseParallel(),
    "mlp.fc2": RowwiseParallel(),
}


class RowwisePartial(RowwiseParallel):
    """Row-parallel, its output left as this rank's partial sum (a local tensor): sequence parallelism
    reduce-scatters it (comm/sequence_split.py) where plain TP all-reduces. The sum's gradient is the same whole
    tensor on every rank, hence ``grad_placements=Replicate``."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local(grad_placements=[Replicate()])


class _PartialInputGradient(torch.autograd.Function):
    """A local tensor as a replicated DTensor whose gradient comes back as this rank's partial sum, unreduced."""

    @staticmethod
    def forward(ctx, x, mesh):
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad):
        return (grad._local_tensor if isinstance(grad, DTensor) else grad), None


class ColwiseSequence(ColwiseParallel):
    """Column-parallel whose input gradient stays this rank's partial sum: sequence parallelism's gather before
    the region reduce-scatters the sum of its layers' partial gradients once (comm/sequence_split.py), where
    ``ColwiseParallel`` all-reduces each layer's."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        return x if isinstance(x, DTensor) else _PartialInputGradient.apply(x, device_mesh)


def _sequence_plan(plan: dict) -> dict:
    swap = {RowwiseParallel: RowwisePartial, ColwiseParallel: ColwiseSequence}
    return {name: swap[type(style)]() for name, style in plan.items()}


def apply_tensor_parallel(
    module: nn.Module, mesh, sequence_overlap: bool = False, sequence_parallel: bool = False
) -> int:
    """Shard every Llama, ViT (audio tower included) and U-Net transformer block of ``module`` over ``mesh``;
    returns how many.

    ``sequence_parallel``: the Llama and ViT block stacks run Megatron's sequence parallelism
    (comm/sequence_split.py): between the TP regions each rank holds 1/tp of the sequence.
    ``sequence_overlap``: the dense Llama blocks run it with chunked all-gather+matmul and matmul+reduce-scatter
    instead (comm/tp_overlap.py); the weights are sharded the same way.
    """
    blocks = 0
    split_unet = unet_splits(module, mesh.size())
    sequence = sequence_parallel and not sequence_overlap
    for child in module.modules():
        if isinstance(child, DecoderBlock) and isinstance(child.feed_forward, MoeFeedForward):
            parallelize_module(child, mesh, _sequence_plan(ATTENTION_PLAN) if sequence_parallel else ATTENTION_PLAN)
            apply_expert_tensor_parallel(child.feed_forward, mesh)
            child.feed_forward.partial_output = sequence_parallel
            blocks += 1
        elif isinstance(child, DecoderBlock):
            parallelize_module(child, mesh, _sequence_plan(LLAMA_PLAN) if sequence else LLAMA_PLAN)
            blocks += 1
        elif isinstance(child, VitBlock):
            parallelize_module(child, mesh, _sequence_plan(VIT_PLAN) if sequence_parallel else VIT_PLAN)
            blocks += 1
        elif isinstance(child, SpatialTransformer) and split_unet:
            parallelize_module(child, mesh, UNET_TRANSFORMER_PLAN)
            blocks += 1
        elif isinstance(child, Llama):
            apply_vocab_parallel(child, mesh)
    if sequence_overlap:
        from ..comm.tp_overlap import enable_overlapped_sequence_parallel

        for child in module.modules():
            if isinstance(child, Llama) and len(child.layers):
                enable_overlapped_sequence_parallel(child, mesh.get_group())
    if sequence_parallel:
        enable_sequence_parallel(module, mesh.get_group(), sequence_overlap)
    return blocks


def enable_sequence_parallel(module: nn.Module, group, skip_dense_llama: bool = False) -> None:
    """One ``SequenceSplit`` per Llama, ViT and audio block stack of ``module``, shared by its blocks (whose norms then
    see 1/tp of the rows: ``sequence_parallel_partial_params``). ``skip_dense_llama``: a Llama of dense blocks
    runs the chunked overlap instead."""
    for child in module.modules():
        if isinstance(child, Llama):
            blocks = list(child.layers.values())
            if skip_dense_llama and not any(isinstance(b.feed_forward, MoeFeedForward) for b in blocks):
                continue
        elif isinstance(child, (VisionTransformer, AudioEncoder)):
            blocks = list(child.blocks.values())
        else:
            continue
        if blocks:
            child.sequence = SequenceSplit(group)
            for block in blocks:
                block.sequence = child.sequence


def sequence_parallel_partial_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters whose gradient each TP rank computes from its sequence rows only (the norms inside a
    sequence-parallel block stack), or from its own heads only (Qwen3's q/k norms, one weight shared by the heads
    that TP splits): summed over the TP group before the data-parallel reduction (used only where TP > 1)."""
    params: list[nn.Parameter] = []
    for child in module.modules():
        if isinstance(child, DecoderBlock) and child.attention.q_norm is not None:
            params += [*child.attention.q_norm.parameters(), *child.attention.k_norm.parameters()]
        if isinstance(child, DecoderBlock) and (child.sequence is not None or getattr(child, "_sequence_parallel", 0)):
            params += [*child.attention_norm.parameters(), *child.ffn_norm.parameters()]
        elif isinstance(child, VitBlock) and child.sequence is not None:
            params += [*child.norm1.parameters(), *child.norm2.parameters()]
    return params


def unet_splits(module: nn.Module, tp: int) -> bool:
    """Do all of ``module``'s U-Net transformers split their heads over ``tp`` ranks? All or none split: where
    the generator shares another unit's TP group (megatron mode's generator stage, or colocated with the LLM)
    and a level's heads do not divide, the U-Net stays replicated in the group (the generator unit of a manual
    layout is refused before launch instead: validation/unit_shapes.py)."""
    blocks = [m for m in module.modules() if isinstance(m, SpatialTransformer)]
    return all((m.attn1.to_q.out_features // m.attn1.head_dim) % tp == 0 for m in blocks)


def apply_vocab_parallel(llm: Llama, mesh) -> None:
    """Split the embedding's and the head's vocabulary rows over ``mesh`` (either may be absent on a pipeline
    stage). The rows must split evenly (validation/layout.py checks tp divides model.llm.vocab_size)."""
    vocab, tp = llm.cfg.vocab_size, mesh.size()
    if vocab % tp:
        raise ValueError(f"tp={tp} does not divide model.llm.vocab_size={vocab}")
    for module in (llm.tok_embeddings, llm.output):
        if module is not None:
            weight = module.weight
            module.weight = nn.Parameter(distribute_tensor(weight.data, mesh, [Shard(0)]), weight.requires_grad)
            module.vocab_mesh = mesh  # what the models read as "vocabulary-parallel" (models/vocab_parallel.py)


def apply_expert_tensor_parallel(moe: MoeFeedForward, mesh) -> None:
    """Split every routed and shared expert's hidden width over ``mesh``: w1 and w3 by rows (output features),
    w2 by columns (input features). Before expert parallelism drops the experts other EP ranks hold."""
    experts = [*moe.experts.values(), *([moe.shared] if moe.shared is not None else [])]
    for expert in experts:
        for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
            linear = getattr(expert, name)
            weight = linear.weight
            linear.weight = nn.Parameter(distribute_tensor(weight.data, mesh, [Shard(dim)]), weight.requires_grad)
    moe.tp_group = mesh.get_group()
