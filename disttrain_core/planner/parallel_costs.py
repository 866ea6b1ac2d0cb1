"""Communication the LLM's context and expert parallelism add to each microbatch (planner/costs.py adds them
to the compute of a stage). Both are per transformer block and sit on the critical path of its forward and
backward, unlike the data-parallel traffic, which waits until the last backward.

Context parallelism (parallel/context_parallel.py, comm/ring_attention.py). Each of the ``cp`` ranks holds
``s / cp`` positions of every sequence (zig-zag: chunks r and 2cp-1-r). Per block, the forward passes the
K/V block ``cp - 1`` times around the ring (K and V: ``s/cp x kv_heads/tp x head_dim`` each, compute dtype)
while the rank attends its queries to the block it holds; the backward passes K/V again (``cp - 1`` hops)
plus the fp32 dK/dV accumulators (``cp`` hops, the last one after the last block's compute). A hop is
hidden behind one block's attention: under zig-zag every off-diagonal hop is one dense product of
``2c x c`` query-key pairs (``c = s / 2cp``), i.e. ``s^2 / (2 cp^2)`` pairs per head, 4 FLOPs per pair and
head dimension forward, twice that backward. Only the part of a hop longer than that compute is counted:

    fwd = (cp - 1) max(0, t(KV) - a)      bwd = (cp - 1) max(0, t(KV + dKV) - 2a) + t(dKV)

with ``t(x) = x / bw + latency per message`` over the CP group's links and ``a`` one hop's forward
attention time at the rate the unit's compute achieves (profiled, or the analytic peak x efficiency).

Expert parallelism (parallel/expert_parallel.py). Per MoE block and microbatch four all-to-alls over the
``ep`` ranks (token dispatch and combine forward, their gradients backward), each moving a rank's
``s / cp x top_k`` assignment rows of ``dim`` values in the compute dtype, ``(ep - 1) / ep`` of them to other
ranks (perfectly balanced routing, nothing dropped), plus one exchange of per-expert counts (latency only):

    a2a = 4 (bytes (ep - 1) / ep / bw + (ep - 1) latency) + (ep - 1) latency

The EP group is ``ep`` consecutive data-parallel replicas of a stage (tp x cp ranks apart), so its links are
those of a span of ``tp x cp x ep`` devices. Neither is overlapped with compute in the runtime.
"""

from __future__ import annotations

from typing import Any, Protocol


class CostModel(Protocol):
    """What these functions read of the planner's cost model (costs.py ``CostModel``, which calls them)."""

    hw: Any
    work: Any
    settings: Any

    def link_bw(self, group_span: int) -> float: ...

    def seconds_per_flop(self, unit: str, tp: int, items: float = 1.0) -> float: ...


def ring_bw(costs: CostModel, span: int) -> float:
    """Point-to-point bandwidth inside a group spanning ``span`` devices: the measured one on a profiled
    machine (capped by the inter-node links when the group leaves the node), else the cluster's link."""
    link = costs.link_bw(span)
    if costs.hw.p2p_bw:
        return min(costs.hw.p2p_bw, link) if span > costs.hw.per_node else costs.hw.p2p_bw
    return link


def ring_attention_exposed_s(
    costs: CostModel, unit: str, tp: int, cp: int, items: float, head_split: int = 1, span: int = 0
) -> float:
    """Seconds of one block's ring exchanges (forward + backward) not hidden behind its attention; a hybrid's
    ring holds ``1 / head_split`` of the heads and spans ``span`` devices (0: tp x cp)."""
    if cp <= 1:
        return 0.0
    w = costs.work.units[unit]
    act = costs.settings.act_bytes
    head_dim = w.dim / w.heads
    local = w.tokens / cp
    kv_heads = (w.kv_heads or w.heads) / tp / head_split
    kv_heads = max(1.0, kv_heads) if head_split > 1 else kv_heads  # a hybrid copies K/V heads up to one per rank
    kv = items * local * kv_heads * head_dim * 2 * act  # K and V of the held block
    dkv = kv * 4 / act  # fp32 gradient accumulators
    bw, latency = ring_bw(costs, span or tp * cp), costs.hw.latency_s
    pairs = items * local * local / 2  # query-key pairs of one off-diagonal zig-zag hop, per head
    attend = 4.0 * pairs * w.dim / tp / head_split * costs.seconds_per_flop(unit, tp)
    forward = (cp - 1) * max(0.0, kv / bw + 2 * latency - attend)
    backward = (cp - 1) * max(0.0, (kv + dkv) / bw + 4 * latency - 2 * attend) + dkv / bw + 2 * latency
    return forward + backward


def _kv_bytes(costs: CostModel, unit: str, tp: int, cp: int, items: float, ulysses: int = 1) -> tuple[float, float]:
    """(one rank's query bytes, its K + V bytes) of one block, K/V heads copied up to ``ulysses`` if fewer."""
    w = costs.work.units[unit]
    act, head_dim = costs.settings.act_bytes, w.dim / w.heads
    rows = items * w.tokens / cp * head_dim * act
    kv_heads = (w.kv_heads or w.heads) / tp
    if ulysses > 1 and kv_heads % ulysses:
        kv_heads = max(kv_heads, ulysses)  # kv_replicas: each head copied ulysses / kv_heads times
    return rows * w.heads / tp, rows * kv_heads * 2


def ulysses_s(costs: CostModel, unit: str, tp: int, cp: int, items: float, ulysses: int) -> float:
    """Seconds of one block's Ulysses all-to-alls over ``ulysses`` ranks (forward: Q, K, V to a head split and
    the output back; backward: the same two reversed), each moving ``(u - 1) / u`` of its bytes; nothing
    overlaps them (comm/context_modes.py)."""
    q, kv = _kv_bytes(costs, unit, tp, cp, items, ulysses)
    moved = 2 * (2 * q + kv) * (ulysses - 1) / ulysses
    return moved / costs.link_bw(tp * ulysses) + 4 * (ulysses - 1) * costs.hw.latency_s


def allgather_kv_s(costs: CostModel, unit: str, tp: int, cp: int, items: float) -> float:
    """Seconds of one block's K/V all-gathers (forward, and again in backward) and its fp32 dK/dV
    reduce-scatter, none overlapped (comm/context_modes.py)."""
    _, kv = _kv_bytes(costs, unit, tp, cp, items)
    bw, latency = costs.link_bw(tp * cp), costs.hw.latency_s
    dkv = kv * 4 / costs.settings.act_bytes
    return (cp - 1) * ((2 * kv + dkv) / bw + 3 * latency)


def context_parallel_s(
    costs: CostModel, unit: str, tp: int, cp: int, items: float, mode: str = "ring", ulysses: int = 1
) -> float:
    """Exposed seconds of one block's context-parallel communication under ``mode`` (parallel.cp_mode)."""
    if cp <= 1:
        return 0.0
    if mode == "allgather":
        return allgather_kv_s(costs, unit, tp, cp, items)
    if mode == "ulysses":
        return ulysses_s(costs, unit, tp, cp, items, cp)
    if mode == "hybrid":
        ring = ring_attention_exposed_s(costs, unit, tp, cp // ulysses, items, head_split=ulysses, span=tp * cp)
        return ulysses_s(costs, unit, tp, cp, items, ulysses) + ring
    return ring_attention_exposed_s(costs, unit, tp, cp, items)


def all_to_all_s(costs: CostModel, unit: str, tp: int, cp: int, ep: int, items: float) -> float:
    """Seconds of one MoE block's all-to-alls for a microbatch of ``items`` sequences (forward + backward)."""
    w = costs.work.units[unit]
    if ep <= 1 or not w.num_experts:
        return 0.0
    rows = items * w.tokens / cp * w.top_k
    nbytes = rows * w.dim * costs.settings.act_bytes * (ep - 1) / ep
    latency = (ep - 1) * costs.hw.latency_s
    return 4 * (nbytes / costs.link_bw(tp * cp * ep) + latency) + latency
