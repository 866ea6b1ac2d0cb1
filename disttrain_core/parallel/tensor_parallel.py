"""Tensor parallelism applied from outside the model, with DTensor plans.

Megatron's pattern on every transformer block: the q/k/v (and the MLP's first)
projections are column-parallel (each rank holds a slice of the heads / hidden
units), the output projections are row-parallel (partial results are summed with
one all-reduce). Blocks take and return ordinary, replicated tensors, so nothing
else in the model changes; the attention code already derives its local head
count from the tensor shapes.

Where TP applies: Llama decoder blocks and ViT blocks. Embeddings, norms outside
the blocks, the output head, the projectors and the U-Net stay replicated inside
the TP group (every TP rank computes them whole): the U-Net's convolutions and
skip connections have no standard TP plan and it is small next to the LLM.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..models.llama import DecoderBlock, Llama
from ..models.vit import VitBlock

LLAMA_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}
VIT_PLAN = {
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.proj": RowwiseParallel(),
    "mlp.fc1": ColwiseParallel(),
    "mlp.fc2": RowwiseParallel(),
}


def apply_tensor_parallel(module: nn.Module, mesh, sequence_overlap: bool = False) -> int:
    """Shard every Llama and ViT block of ``module`` over ``mesh``; returns how many blocks.

    ``sequence_overlap``: Llama blocks then run sequence-parallel with chunked all-gather+matmul and
    matmul+reduce-scatter (comm/tp_overlap.py); the weights are sharded the same way.
    """
    blocks = 0
    for child in module.modules():
        if isinstance(child, DecoderBlock):
            parallelize_module(child, mesh, LLAMA_PLAN)
            blocks += 1
        elif isinstance(child, VitBlock):
            parallelize_module(child, mesh, VIT_PLAN)
            blocks += 1
    if sequence_overlap:
        from ..comm.tp_overlap import enable_overlapped_sequence_parallel

        for child in module.modules():
            if isinstance(child, Llama) and len(child.layers):
                enable_overlapped_sequence_parallel(child, mesh.get_group())
    return blocks
