"""Hot-switch plans (parallel/switch_plan.py) for every ordered pair of six 4-rank strategies (30 pairs)
and for 8 ranks on two nodes: every receiver gets exactly the slices its new box needs (each element once),
no rank sends more than ceil(bytes of an owner set / owners) + the largest slice of the set, fused messages
are the sums of their parts, and the node preference serves receivers from their own node."""

import itertools
import math

import pytest

from disttrain_core.parallel.switch_plan import (
    ParamSpec,
    PlanCache,
    Strategy,
    plan_switch,
    slices,
    strategy_layout,
)

LAYERS = 4


def llama_specs(dim=8, ffn=16, vocab=12, kv=4) -> dict[str, ParamSpec]:
    specs = {"tok_embeddings.weight": ParamSpec((vocab, dim)), "norm.weight": ParamSpec((dim,), edge="last")}
    specs["output.weight"] = ParamSpec((vocab, dim), edge="last")
    for i in range(LAYERS):
        p = f"layers.{i}."
        specs[p + "attention.wq.weight"] = ParamSpec((dim, dim), 0, i)
        specs[p + "attention.wk.weight"] = ParamSpec((kv, dim), 0, i)
        specs[p + "attention.wv.weight"] = ParamSpec((kv, dim), 0, i)
        specs[p + "attention.wo.weight"] = ParamSpec((dim, dim), 1, i)
        specs[p + "feed_forward.w1.weight"] = ParamSpec((ffn, dim), 0, i)
        specs[p + "feed_forward.w2.weight"] = ParamSpec((dim, ffn), 1, i)
        specs[p + "attention_norm.weight"] = ParamSpec((dim,), None, i)
    return specs


STRATEGIES = [Strategy(4), Strategy(tp=4), Strategy(pp=4), Strategy(2, 2), Strategy(2, 1, 2), Strategy(1, 2, 2)]
PAIRS = [(a, b) for a, b in itertools.permutations(STRATEGIES, 2)]


def _cells(box):
    return set(itertools.product(*[range(a, b) for a, b in box]))


def _check(specs, source, target, plan):
    shapes = {n: s.shape for n, s in specs.items()}
    src, dst = strategy_layout(specs, source, LAYERS), strategy_layout(specs, target, LAYERS)
    got = {}
    for t in plan.local + plan.transfers():
        assert t.sender in src[t.name] and all(
            a0 <= c0 and c1 <= a1 for (a0, a1), (c0, c1) in zip(src[t.name][t.sender], t.box, strict=True)
        ), f"{t.sender} sends {t.name}{t.box} it does not hold"
        assert t.numel == math.prod(b - a for a, b in t.box)
        elements = _cells(t.box)
        mine = got.setdefault((t.receiver, t.name), set())
        assert not (mine & elements), f"rank {t.receiver} receives part of {t.name} twice"
        mine |= elements
    for name in shapes:
        for rank, box in dst[name].items():
            assert got.get((rank, name), set()) == _cells(box), (source.name, target.name, rank, name)
    assert {k for k in got} == {(r, n) for n in shapes for r in dst[n]}  # nothing sent to a non-holder
    return src, dst


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{a.name}-{b.name}" for a, b in PAIRS])
def test_every_receiver_gets_exactly_its_new_box_and_senders_are_balanced(source, target):
    specs = llama_specs()
    shapes = {n: s.shape for n, s in specs.items()}
    src, dst = strategy_layout(specs, source, LAYERS), strategy_layout(specs, target, LAYERS)
    plan = plan_switch(shapes, src, dst)
    _check(specs, source, target, plan)
    for (sender, receiver), transfers in plan.messages.items():  # fused message = sum of its parts
        assert plan.message_numel(sender, receiver) == sum(t.numel for t in transfers) > 0
    # the balance bound, per set of owners (list scheduling on one node)
    by_set = {}
    for name in sorted(shapes):
        for cell, owners, receivers in slices(shapes[name], src[name], dst[name]):
            numel = math.prod(b - a for a, b in cell)
            entry = by_set.setdefault(tuple(owners), {"bytes": 0, "largest": 0, "sent": {}})
            remote = [r for r in receivers if r not in owners]
            entry["bytes"] += numel * len(remote)
            entry["largest"] = max(entry["largest"], numel) if remote else entry["largest"]
    for owners, entry in by_set.items():
        bound = -(-entry["bytes"] // len(owners)) + entry["largest"]
        for rank in owners:
            sent = sum(t.numel for t in plan.transfers() if t.sender == rank and tuple(slices_owner(src, t)) == owners)
            assert sent <= bound, (source.name, target.name, owners, rank, sent, bound)


def slices_owner(src, t):
    return [r for r, box in sorted(src[t.name].items()) if _holds(box, t.box)]


def _holds(box, cell):
    return all(a <= c and d <= b for (a, b), (c, d) in zip(box, cell, strict=True))


def test_same_strategy_moves_nothing_and_plans_are_cached():
    specs = llama_specs()
    shapes = {n: s.shape for n, s in specs.items()}
    layouts = {s.name: strategy_layout(specs, s, LAYERS) for s in STRATEGIES}
    cache = PlanCache(shapes, layouts)
    same = cache.get("dp2tp2", "dp2tp2")
    assert not same.messages and len(same.local) > 0
    assert cache.get("tp2pp2", "dp4") is cache.get("tp2pp2", "dp4")
    # dp4 -> tp4: every rank already holds everything; nothing travels
    assert not cache.get("dp4", "tp4").messages
    # tp4 -> dp4: each rank receives the 3/4 of each sharded weight it lacks
    wq = specs["layers.0.attention.wq.weight"].shape
    plan = cache.get("tp4", "dp4")
    assert (
        sum(t.numel for t in plan.transfers() if t.name == "layers.0.attention.wq.weight") == 4 * 3 * math.prod(wq) // 4
    )


def test_two_nodes_prefer_a_sender_on_the_receivers_node():
    """8 ranks, 4 per node: from dp2tp4 (each node one replica) to tp8 nothing needs to leave a node."""
    specs = llama_specs(dim=16, ffn=32, kv=8)
    shapes = {n: s.shape for n, s in specs.items()}
    node = lambda rank: rank // 4  # noqa: E731
    for source, target in [
        (Strategy(2, 4), Strategy(tp=8)),
        (Strategy(2, 4), Strategy(8)),
        (Strategy(2, 2, 2), Strategy(4, 2)),
    ]:
        src, dst = strategy_layout(specs, source, LAYERS), strategy_layout(specs, target, LAYERS)
        plan = plan_switch(shapes, src, dst, node)
        _check(specs, source, target, plan)
        for t in plan.transfers():
            owners = slices_owner(src, t)
            if any(node(o) == node(t.receiver) for o in owners):
                assert node(t.sender) == node(t.receiver), (source.name, target.name, t)
    # dp2tp4 -> tp8: a node's replica has every slice its own ranks need
    plan = plan_switch(
        shapes, strategy_layout(specs, Strategy(2, 4), LAYERS), strategy_layout(specs, Strategy(tp=8), LAYERS), node
    )
    assert all(node(s) == node(r) for s, r in plan.messages)


def test_a_slice_nobody_holds_is_refused():
    with pytest.raises(ValueError, match="held by no rank"):
        plan_switch({"w": (4,)}, {"w": {0: ((0, 2),)}}, {"w": {1: ((0, 4),)}})
    with pytest.raises(ValueError, match="does not divide by tp=4"):
        strategy_layout({"w": ParamSpec((6, 2), 0, 0)}, Strategy(tp=4), 4)
