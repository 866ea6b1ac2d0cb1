"""The memory half of the cost model (planner/costs.py ``CostModel`` mixes it in): activations saved for
backward under each recompute policy (Korthikanti et al.'s accounting redone for these blocks, checked
against autograd in tests/unit/test_planner.py), what recompute holds while a block reruns, its time
factor, and the model state and step transients of each shard mode (planner/memory.py)."""

from __future__ import annotations

import functools

from ..parallel.units import ENCODER_UNITS
from .memory import ModelState, model_state, transient_bytes, unit_model_state


def memoized(method):
    """Cache a cost of the model by its arguments (the solver asks for the same few hundred thousand times; a
    CostModel's workload, hardware and settings never change)."""

    @functools.wraps(method)
    def cached(self, *args, **kwargs):
        memo = self.__dict__.setdefault("_costs_memo", {})
        key = (method.__name__, args, tuple(sorted(kwargs.items()))) if kwargs else (method.__name__, args)
        if key not in memo:
            memo[key] = method(self, *args, **kwargs)
        return memo[key]

    return cached


class MemoryCosts:
    """Reads ``self.work``, ``self.settings`` and ``self.local_params`` / ``self._split_params`` of the
    CostModel it is mixed into."""

    def split_tp(self, unit: str, tp: int) -> int:
        """The TP degree ``unit``'s blocks split over on a TP group of ``tp``: the generator's U-Net stays whole
        (1) where ``tp`` does not divide its transformers' heads (parallel/tensor_parallel.py ``unet_splits``)."""
        if unit == "generator" and not self.work.units[unit].tp_allowed(tp):
            return 1
        return tp

    def _policy(self, policy: str | None) -> str:
        """The policy to cost: the given one, else the setting; ``auto`` (chosen per unit by
        LayoutModel.evaluate) costs as ``full`` where no unit is given, so memory bounds stay lower bounds."""
        policy = policy or self.settings.recompute
        return "full" if policy == "auto" else policy

    def _element_bytes(self) -> tuple[float, float]:
        """(a, r): bytes of an activation element and of a residual-stream / norm element. Under bf16-mixed
        autocast the matmuls' and attention's outputs are bf16 (a = 2) while the residual stream and the norms
        stay fp32 (r = 4); in fp32 both are 4."""
        a = float(self.settings.act_bytes)
        return a, 4.0

    def _unet_counts(self, w) -> dict[str, float]:
        """The U-Net's counted bytes per item by policy: fp32, or under bf16-mixed with the autocast policy of the
        cluster's device (CUDA keeps norms and softmax in fp32 where the CPU keeps its input's bf16)."""
        if self.settings.act_bytes == 2:
            return w.counted_mixed["cpu" if self.hw.device == "cpu" else "cuda"]
        return {"none": w.counted_activation_bytes, **w.counted_recompute_bytes}

    def sequence_share(self, unit: str, tp: int, cp: int = 1) -> float:
        """The share of a sequence's rows one TP rank keeps between the TP regions: 1 without sequence
        parallelism, else its padded chunk, ceil(rows / tp) / rows (comm/sequence_split.py), where rows are the
        context-parallel rank's share of an item's tokens. The U-Net is not sequence-parallel."""
        w = self.work.units[unit]
        if not self.settings.sequence_parallel or tp <= 1 or w.counted_activation_bytes:
            return 1.0
        rows = max(1, round(w.tokens / cp))
        return -(-rows // tp) / rows

    def _block_bytes(self, unit: str, tp: int, cp: int = 1) -> tuple[float, float]:
        """Bytes per token and model dimension one block keeps for backward without recompute, and with
        selective_op (checked against what autograd saves in fp32 and under CPU bf16 autocast in
        tests/unit/test_memory_precision.py).

        Without recompute, replicated over TP: each norm's input (and RMSNorm its normalized input: the
        Llama blocks), and the linear layers' input -- one shared fp32 tensor in fp32, one bf16 copy per
        linear layer under autocast (autocast casts the input at every call: q, k, v and the MLP's first
        matmul(s)). Split by TP: q, k, v (k and v scaled by kv_heads / heads), the attention output, and the
        MLP's hidden activations (2 per hidden element for GELU: its input and output; 4 for SwiGLU: gate, up,
        SiLU, product). Flash attention (CUDA and CPU SDPA) and ring attention keep no s x s scores; RoPE
        keeps nothing per token (its table is constant).
        selective_op keeps the block input, the outputs of the matmuls and of attention (q, k, v, the
        attention output, the two projections back to h, the MLP's first matmul(s)).
        Sequence parallelism (``sequence_share``) shrinks the norms' saved tensors and the block input; the
        linear layers still save the gathered whole-sequence input, and the row-parallel matmuls' outputs
        (selective_op) are the whole-sequence partial sums before the reduce-scatter.

        A MoE feed-forward (models/moe.py; checked against autograd in tests/unit/test_planner_cp_ep.py and
        tests/unit/test_memory_precision.py) keeps, per token and routed expert, the expert's sorted input row
        (residual precision), its two first matmuls' inputs (bf16 copies under autocast), its SwiGLU hidden
        activations (4 x expert width) and its output (twice in fp32: reordered, and saved by the gate
        product); the shared experts' hidden activations; index and router tensors too small to count. TP splits
        the hidden activations (each rank runs its slice of every expert's width), not the rows or outputs.
        """
        w = self.work.units[unit]
        a, r = self._element_bytes()
        mixed = r != a
        kv = (w.kv_heads / w.heads) if w.kv_heads else 1.0
        llama = w.gated_mlp or bool(w.num_experts)  # RMSNorm + SwiGLU blocks; else LayerNorm + GELU (ViT)
        rows = self.sequence_share(unit, tp, cp)
        per_norm = (2.0 * r if llama else r) * rows
        attention_inputs = 3.0 * a if mixed else r  # q, k, v linear layers
        attention = (2.0 + 2.0 * kv) * a / tp  # q, k, v, output
        if w.num_experts:
            width = w.expert_dim / w.dim / tp  # each TP rank's slice of an expert's hidden width
            routed = r + (2.0 * a if mixed else 0.0) + 4.0 * width * a + (a if mixed else 2.0 * a)
            shared = (4.0 * width * a + (2.0 * a if mixed else 0.0)) * w.shared_experts
            none = 2.0 * per_norm + attention_inputs + (a if mixed else r) + attention + w.top_k * routed + shared
            selective = (
                r * rows
                + 2.0 * a
                + attention
                + w.top_k * (r + 2.0 * width * a + a)
                + 2.0 * width * a * w.shared_experts
            )
            return none, selective
        first_matmuls = 2.0 if w.gated_mlp else 1.0
        mlp_inputs = first_matmuls * a if mixed else r
        hidden = (4.0 if w.gated_mlp else 2.0) * w.mlp_ratio * a / tp
        none = 2.0 * per_norm + attention_inputs + mlp_inputs + attention + hidden
        selective = r * rows + 2.0 * a + attention + first_matmuls * w.mlp_ratio * a / tp
        return none, selective

    @memoized
    def activation_bytes(self, unit: str, tp: int, items: float, policy: str | None = None, cp: int = 1) -> float:
        """Bytes saved for backward by the whole unit for ``items`` items (one microbatch), under the
        recompute policy (parallel/recompute.py): none, full (a block keeps its input), selective_op, or
        every_k (every k-th block full, the rest none). A context-parallel rank holds 1/cp of every
        sequence and so 1/cp of every tensor (ring attention saves what flash attention does: its q, k, v,
        output and log-sum-exp). ``auto`` without a unit's choice: the least any policy it may choose keeps (a
        bound)."""
        if self.forward_only(unit):
            return 0.0
        if (policy or self.settings.recompute) == "auto":
            least = ("full", *(() if self.settings.sequence_parallel else ("full_partitioned",)))
            least += ("offload",) if self.settings.offload else ()
            return min(self.activation_bytes(unit, tp, items, p, cp) for p in least)
        w = self.work.units[unit]
        policy = self._policy(policy)
        if w.counted_activation_bytes:  # U-Net: counted on fake CPU tensors with the runtime's wrappers
            counted = self._unet_counts(w)
            if policy == "every_k":  # between none and full, by the share of blocks recomputed
                k = self.settings.recompute_every
                kept = counted["none"] - (counted["none"] - counted["full"]) / k
            else:  # offload, full_partitioned: at most what full keeps (the modules outside the blocks)
                kept = counted[policy if policy in counted else "full"]
            return items * kept
        none, selective = self._block_bytes(unit, tp, cp)
        _, r = self._element_bytes()
        r_in = r * self.sequence_share(unit, tp, cp)  # the block input: the residual stream (this rank's rows)
        per_layer = {
            "none": none,
            "full": r_in,
            "full_partitioned": r_in / self.split_tp(unit, tp),  # 1/tp of each input (sequence parallelism off)
            "offload": 0.0,  # on the host; what comes back for a backward: recompute_transient_bytes
            "selective_op": selective,
            "every_k": (r_in + (self.settings.recompute_every - 1) * none) / self.settings.recompute_every,
        }[policy]
        return items * (w.tokens / cp) * w.dim * per_layer * w.layers

    @memoized
    def forward_only(self, unit: str) -> bool:
        """An encoder with every parameter frozen: fed by data, nothing of it needs a gradient, so it saves nothing
        for a backward (its own unit's stages run forwards only: schedule/actions.py ``drop_backward``;
        colocated, autograd keeps nothing for it)."""
        return unit in ENCODER_UNITS and self.work.units[unit].trainable_fraction == 0

    def recompute_transient_bytes(
        self, unit: str, tp: int, items: float, policy: str | None = None, cp: int = 1
    ) -> float:
        """Extra bytes while one recomputed block runs its backward: what recompute dropped, for one block
        (1/cp of it on a context-parallel rank); under ``offload`` two blocks' saved tensors, the one whose
        backward runs and the one prefetched for the next (parallel/saved_activations.py)."""
        w = self.work.units[unit]
        policy = self._policy(policy)
        if policy == "none" or self.forward_only(unit):
            return 0.0
        if w.counted_activation_bytes:  # U-Net: its largest block, counted
            return items * self._unet_counts(w).get("largest_block", 0.0) * (2 if policy == "offload" else 1)
        none, selective = self._block_bytes(unit, tp, cp)
        _, r = self._element_bytes()
        kept = {"selective_op": selective, "offload": -none}.get(policy, r * self.sequence_share(unit, tp, cp))
        if policy == "full_partitioned":
            kept /= self.split_tp(unit, tp)
        return items * (w.tokens / cp) * w.dim * (none - kept)

    def saved_activation_s(
        self, unit: str, policy: str | None, compute: float, tp: int, items: float, cp: int = 1, share: float = 1.0
    ) -> float:
        """``compute`` (seconds of ``share`` of the unit's blocks, recompute included) with what the policy's
        movements add. ``offload``: the saved bytes go to the host during the forward (a third of the compute) and
        come back during the backward (two thirds), each direction at ``cluster.host_bandwidth_gbps`` and hidden up to
        the compute it overlaps. ``full_partitioned``: before each block reruns, an all-gather of its input over
        the TP group (not overlapped)."""
        policy = policy or self.settings.recompute
        if policy == "offload":
            moved = self.activation_bytes(unit, tp, items, "none", cp) * share / self.hw.host_bw
            return max(compute / 3.0, moved) + max(2.0 * compute / 3.0, moved)
        if policy == "full_partitioned" and self.split_tp(unit, tp) > 1:
            w, n = self.work.units[unit], self.split_tp(unit, tp)
            gathered = items * (w.tokens / cp) * w.dim * self._element_bytes()[1]
            gather = (n - 1) / n * gathered / self.hw.intra_bw + (n - 1) * self.hw.latency_s
            return compute + w.layers * share * gather
        return compute

    @memoized
    def attention_transient_bytes(
        self, unit: str, tp: int, items: float, cp: int = 1, cp_mode: str = "ring", cp_ulysses: int = 1
    ) -> float:
        """Extra bytes while one block's ring attention runs its backward (context parallelism; comm/
        ring_attention.py), beyond what the block saved: the fp32 dq accumulator, the fp32 dk/dv accumulators
        of the block held and of the one arriving, the next key/value block, and the kernel's block gradients
        (dq, dk, dv in the activation dtype). The forward holds less (an fp32 output accumulator, the next
        key/value block, one block output). No s x s term: the blocks run on a fused kernel. On CUDA in fp32 (the
        memory-efficient kernel) grouped keys and values are expanded to the query heads per block, and their
        block gradients come back full-headed before they are summed. Not counted: packed documents' per-block
        mask, B x S_q x S_k in the activation dtype plus two boolean temporaries (HotSPa strategies with cp).

        Other modes (parallel.cp_mode, comm/context_modes.py): ``allgather`` holds every rank's K/V and, in the
        backward, the fp32 dK/dV of every block (cp of each in place of the ring's one or two); ``ulysses`` has no
        ring accumulators but the all-to-all's send and receive buffers of Q, K and V (K/V heads copied up to one
        per rank) and its attention's block gradients; ``hybrid`` both, its ring holding 1/u of the heads of
        u x the positions (the same bytes as the ring's)."""
        if cp <= 1:
            return 0.0
        w = self.work.units[unit]
        a, _ = self._element_bytes()
        kv = (w.kv_heads / w.heads) if w.kv_heads else 1.0
        if cp_mode == "allgather":
            per_token_dim = 4.0 + cp * 2.0 * 4.0 * kv + cp * 2.0 * a * kv + a * (1.0 + 2.0 * kv)
            return items * (w.tokens / cp) * w.dim * per_token_dim / tp
        ulysses = cp if cp_mode == "ulysses" else (cp_ulysses if cp_mode == "hybrid" else 1)
        if ulysses > 1:
            kv_heads = (w.kv_heads or w.heads) / tp
            copied = kv * max(1.0, ulysses / kv_heads) if kv_heads % ulysses else kv
            swap = 2.0 * a * (1.0 + 2.0 * copied) + a * (1.0 + 2.0 * copied)
            if cp_mode == "ulysses":
                return items * (w.tokens / cp) * w.dim * swap / tp
            kv = copied
        else:
            swap = 0.0
        per_token_dim = swap + 4.0 + 2.0 * 2.0 * 4.0 * kv + 2.0 * a * kv + a * (1.0 + 2.0 * kv)
        if self.hw.device == "cuda" and a == 4.0:
            per_token_dim += 4.0 * a * (1.0 - kv)
        per_token_dim /= tp
        return items * (w.tokens / cp) * w.dim * per_token_dim

    def recompute_factor(self, unit: str, policy: str | None = None) -> float:
        """Compute time with recompute over without: full runs each block's forward again (a third of its
        forward + backward FLOPs), every_k does so for 1/k of the blocks; selective_op reruns no matmul and
        is counted as free."""
        w = self.work.units[unit]
        policy = policy or self.settings.recompute  # auto without a unit's choice: no recompute (a lower bound)
        if policy in ("none", "selective_op", "offload", "auto") or w.counted_activation_bytes or not w.train_flops:
            return 1.0
        blocks = (w.train_flops - w.flops_not_tp - w.flops_head) / w.train_flops
        share = 1.0 / self.settings.recompute_every if policy == "every_k" else 1.0  # full, full_partitioned
        return 1.0 + blocks * share / 3.0

    def shard_of(self, shard: str | None) -> str:
        """A unit's shard mode: given, or ``planner.shard``; ``auto`` without a unit's choice is zero3, the
        least state (a lower bound, as pruning needs)."""
        shard = shard or self.settings.shard
        return "zero3" if shard == "auto" else shard

    @memoized
    def state(
        self,
        unit: str,
        tp: int,
        dp: int,
        pp: int,
        shard: str | None = None,
        stage: int | None = None,
        hsdp_replicas: int = 1,
        cp: int = 1,
        ep: int = 1,
    ) -> ModelState:
        """Model state per rank (planner/memory.py) of pipeline stage ``stage`` of ``unit`` (None: the
        average stage, a lower bound of the fullest). Non-expert parameters are sharded over the dp x cp
        ranks that reduce their gradients, the rank's 1/ep of the routed experts over dp x cp / ep."""
        w = self.work.units[unit]
        dense, experts = self._split_params(unit, tp, pp, stage, ep)
        f = w.trainable_fraction
        if not experts and cp == 1:
            st = self.settings
            return model_state(
                dense, dense * f, dp, self.shard_of(shard), hsdp_replicas, st.act_bytes, st.moment_bytes, st.outer_bytes
            )
        return unit_model_state(
            dense, experts, f, dp * cp, ep, self.shard_of(shard), hsdp_replicas, self.settings.act_bytes
        )

    def state_bytes(
        self, unit: str, tp: int, dp: int, pp: int, shard: str | None = None, stage: int | None = None
    ) -> float:
        return self.state(unit, tp, dp, pp, shard, stage).total

    def largest_group(self, unit: str, tp: int, ep: int = 1) -> float:
        """Parameters of the largest FSDP group: a block, or the LLM's embedding / LM head. Under expert
        parallelism the experts are not in it (FSDP2 ignores them: they stay whole on their ranks)."""
        w = self.work.units[unit]
        held = self._held_params(unit, tp, ep)
        if unit == "generator":  # the U-Net is one group: its replicated part and this rank's transformer slices
            return float(w.params_rep) + held
        block = held / max(1, w.layers) if w.params_tp else float(w.params_rep)
        return max(block, self._head_params(unit, tp))

    def _held_params(self, unit: str, tp: int, ep: int) -> float:
        """A rank's tensor-parallel slice of the unit's FSDP-sharded parameters (experts only without EP: FSDP2
        ignores them under it)."""
        w = self.work.units[unit]
        tp = self.split_tp(unit, tp)
        return w.params_dense_tp / tp + w.params_moe_rep + (w.params_expert / tp if ep == 1 else 0.0)

    def _head_params(self, unit: str, tp: int) -> float:
        """The LLM's vocabulary-parallel LM head (or embedding) on one rank; 0 for other units."""
        return self.work.vocab * self.work.units[unit].dim / self.split_tp(unit, tp) if unit == "llm" else 0.0

    def kept_params(self, unit: str, tp: int, ep: int = 1) -> float:
        """Parameters zero3 keeps gathered from their forward to their backward on a one-stage layout
        (parallel/fsdp.py ``kept_after_forward``): the last block and, for the LLM, the LM head (the root's norms
        and projectors are not counted)."""
        w = self.work.units[unit]
        block = self._held_params(unit, tp, ep) / max(1, w.layers) if w.params_tp else 0.0
        return block + self._head_params(unit, tp)

    @memoized
    def step_transient_bytes(
        self,
        unit: str,
        tp: int,
        pp: int,
        shard: str | None,
        in_flight: int,
        stage: int | None = None,
        ep: int = 1,
        pipelined: bool = False,
    ) -> float:
        """Gathered FSDP2 parameters and autocast's weight copies (planner/memory.py ``transient_bytes``);
        ``pipelined``: the layout has more than one pipeline stage."""
        mixed = self.settings.precision.startswith("bf16")
        local = self.local_params(unit, tp, pp, stage, ep)
        group = self.largest_group(unit, tp, ep)
        return transient_bytes(
            local, group, self.shard_of(shard), in_flight, mixed, self.settings.act_bytes, pipelined=pipelined
        )
