"""What the planner knows about each unit of a model (``UnitWork``) and the model as a whole (``Workload``):
FLOPs, parameters, shapes and counted activations, built by planner/workload.py from the model itself."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class UnitWork:
    name: str
    train_flops: float  # forward + backward FLOPs per item
    flops_not_tp: float  # the part tensor parallelism does not split (replicated modules, the projectors)
    params_tp: int  # parameters inside transformer blocks (sharded by TP)
    params_rep: int  # parameters outside the blocks (embeddings, norms, head, projector, U-Net); replicated in a
    # TP group but for the vocabulary rows (vocab_first, vocab_last)
    trainable_fraction: float  # share of the parameters that have gradients and optimizer states
    items_per_sample: float
    layers: int  # transformer blocks (pipeline stages split these); 1 for the U-Net
    tokens: int  # tokens per item (patches per image, seq_len per sequence, latent cells per sample)
    dim: int  # block width (activation rows)
    heads: int
    mlp_ratio: float  # MLP hidden / dim
    gated_mlp: bool  # SwiGLU (three matrices) or GELU (two)
    boundary_floats: int  # floats per item sent to the next unit (0 for the last)
    # U-Net: bytes saved for backward per item in fp32 (counted on fake CPU tensors, planner/activation_count.py);
    # the same under full / selective_op and its largest block
    counted_activation_bytes: float = 0.0
    counted_recompute_bytes: dict = field(default_factory=dict)
    # ... and under bf16 autocast, per device kind ("cuda", "cpu": their autocast policies differ): {"none", "full",
    # "selective_op", "largest_block"}
    counted_mixed: dict = field(default_factory=dict)
    # Units whose TP-split blocks differ in width (the U-Net's transformers, one per level): the all-reduces one
    # item's training step runs and the elements they carry (0: ``4 layers`` all-reduces of tokens x dim)
    tp_reduces: int = 0
    tp_reduce_floats: float = 0.0
    # The U-Net's pipeline pieces (parallel/generator_stages.py): (replicated, TP-split) parameters of the first
    # stage's extras (projector, conv_in, timestep MLP), of each segment, and of the last stage's output layers
    pieces: tuple = ()
    # ... and the floats per item a stage boundary carries after each segment but the last (the skips not yet
    # consumed, the running features, the timestep embedding and the conditioning)
    cut_floats: tuple = ()
    kv_heads: int = 0  # grouped-query attention (LLM)
    # Of params_rep, what the first pipeline stage holds (embeddings) and the last (final norm, head,
    # projector); the blocks split evenly. params_rep = params_first + params_last.
    params_first: int = 0
    params_last: int = 0
    # Mixture of experts (LLM with ``llm.moe``; all 0 for dense units). Of params_tp, the routed experts
    # (expert parallelism holds experts/ep of them, TP splits each one's hidden width) and the routers, which
    # every TP rank holds and runs whole (parallel/tensor_parallel.py); the shared experts split like dense MLPs.
    params_expert: int = 0
    params_moe_rep: int = 0
    flops_moe: float = 0.0  # forward + backward FLOPs per item of the MoE routers (TP does not split them)
    num_experts: int = 0
    top_k: int = 0
    expert_dim: int = 0  # hidden width of one expert
    shared_experts: int = 0
    # Vocabulary parallelism (LLM): of params_first / params_last, the embedding's and the head's rows, which
    # tensor parallelism splits (parallel/tensor_parallel.py apply_vocab_parallel); vocab: their row count
    vocab: int = 0
    vocab_first: int = 0
    vocab_last: int = 0
    flops_head: float = 0.0  # forward + backward FLOPs per item of the head (split by TP, never recomputed)

    @property
    def params(self) -> int:
        return self.params_tp + self.params_rep

    @property
    def params_dense_tp(self) -> int:
        """Block parameters TP shards outside the routed experts: attention, dense MLPs, shared experts."""
        return self.params_tp - self.params_expert - self.params_moe_rep

    @property
    def flops_unsplit(self) -> float:
        """FLOPs per item TP does not divide: the replicated modules and the MoE routers."""
        return self.flops_not_tp + self.flops_moe

    def active_params(self) -> float:
        """Parameters one token uses: all but the routed experts it is not sent to (top_k of num_experts)."""
        if not self.num_experts:
            return float(self.params)
        return self.params - self.params_expert * (1.0 - self.top_k / self.num_experts)

    def tp_allowed(self, tp: int) -> bool:
        """Can the runtime shard this unit's blocks over ``tp`` devices (heads, KV heads, MLP width)?"""
        if tp == 1:
            return True
        if not self.params_tp:
            return False  # nothing to split: TP would only cost devices
        hidden = round(self.dim * self.mlp_ratio)
        return (
            self.heads % tp == 0
            and hidden % tp == 0
            and (not self.kv_heads or self.kv_heads % tp == 0)
            and (not self.vocab or self.vocab % tp == 0)
            and (not self.num_experts or self.expert_dim % tp == 0)
        )

    def rep_local(self, tp: int, part: str = "all") -> float:
        """Of the parameters outside the blocks (``part``: "first", "last" or "all"), what one TP rank holds:
        the vocabulary rows 1/tp, the rest whole."""
        held, vocab = {
            "first": (self.params_first, self.vocab_first),
            "last": (self.params_last, self.vocab_last),
            "all": (self.params_rep, self.vocab_first + self.vocab_last),
        }[part]
        return held - vocab + vocab / tp


@dataclass(frozen=True)
class Workload:
    model: str
    seq_len: int
    vocab: int
    llm_dim: int
    units: dict[str, UnitWork]
    loss_chunk: int = 0  # model.loss_chunk: positions of logits held at once (0: all of them)

    def get(self, name: str) -> UnitWork | None:
        return self.units.get(name)
