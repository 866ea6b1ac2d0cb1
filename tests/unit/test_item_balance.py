"""Item rebalancing's plan (comm/item_balance.py) and its bad input. The plan is a pure function of the replicas'
item counts: balanced to within one item, every moved item moves once, only surplus moves, and the order it
restores is the order the items left in (checked here on index tensors, in one process: the exchange is an
identity per rank). The training runs that prove it against one process: tests/distributed/test_item_balance.py."""

import random

import pytest
import torch

from disttrain_core.comm.item_balance import ItemPlan, balance_moves, balance_targets
from disttrain_core.config import compose, typed_config


def _random_counts(rng: random.Random) -> list[int]:
    n = rng.randint(1, 9)
    return [rng.choice([0, 0, 1, 2, 3, 7, 12]) for _ in range(n)]


def test_the_plan_balances_to_one_item_and_moves_only_the_surplus():
    rng = random.Random(0)
    for _ in range(500):
        counts = _random_counts(rng)
        moves = balance_moves(counts)
        targets = balance_targets(counts)
        assert [sum(row) for row in moves] == counts  # every item goes somewhere
        received = [sum(row[d] for row in moves) for d in range(len(counts))]
        assert received == targets and max(targets) - min(targets) <= 1
        for s, row in enumerate(moves):  # a replica over its target only sends, one under it only receives
            sent = sum(row) - row[s]
            got = received[s] - row[s]
            assert not (sent and got)
        surplus = sum(max(0, c - t) for c, t in zip(counts, targets, strict=True))
        assert ItemPlan.of(counts, 0).moved == surplus  # the fewest moves a balanced plan can make


def test_the_extra_items_stay_with_the_replicas_that_hold_the_most():
    assert balance_targets([1, 6, 0, 3]) == [2, 3, 2, 3]
    assert balance_moves([7, 0, 0, 0]) == [[2, 2, 2, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert ItemPlan.of([5, 1, 0, 2], 0).largest == (5, 2)
    with pytest.raises(ValueError, match="must not be negative"):
        balance_moves([1, -1])


class _Exchange:
    """Every rank's plan run at once in one process: what ``all_to_all`` would deliver, by the plans' splits."""

    def __init__(self, counts):
        self.plans = [ItemPlan.of(counts, r) for r in range(len(counts))]

    def run(self, items: list[torch.Tensor]) -> list[torch.Tensor]:
        outbound = [p._outbound_order(x).split(p.send) for p, x in zip(self.plans, items, strict=True)]
        held = [torch.cat([outbound[s][d] for s in range(len(items))]) for d in range(len(items))]
        # each rank "encodes" by keeping the item ids; the inverse exchange sends each row back to its source
        back = [h.split(p.receive) for p, h in zip(self.plans, held, strict=True)]
        returned = [torch.cat([back[d][s] for d in range(len(items))]) for s in range(len(items))]
        return [p._own_order(r) for p, r in zip(self.plans, returned, strict=True)], held


def test_every_rank_gets_its_own_items_back_in_order():
    rng = random.Random(1)
    for _ in range(200):
        counts = _random_counts(rng)
        start = [sum(counts[:r]) for r in range(len(counts))]
        items = [torch.arange(s, s + c) for s, c in zip(start, counts, strict=True)]
        got, held = _Exchange(counts).run(items)
        assert all(torch.equal(g, x) for g, x in zip(got, items, strict=True))
        assert [len(h) for h in held] == balance_targets(counts)
        assert sorted(torch.cat(held).tolist()) == list(range(sum(counts)))  # each item encoded exactly once


BAD = [
    (["model=llama_tiny", "parallel=zero1"], "model llama_tiny has no encoder"),
    (["parallel=zero1", "trainer.devices=1"], "every encoder runs in one data-parallel replica"),
    (["parallel=dp"], "torch DDP runs the whole model as one module"),
    (["parallel=disagg4_enc2", "parallel.units.encoder.pp=2", "trainer.devices=6"], "use parallel.units.encoder.pp=1"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=["no_encoder", "one_replica", "ddp", "encoder_pp2"])
def test_bad_rebalancing_is_one_line(overrides, message):
    from disttrain_core.planner.fit import validate_run
    from disttrain_core.validation import ConfigError

    cfg = compose(["trainer.devices=2", *overrides, "parallel.rebalance_items=true"])
    with pytest.raises(ConfigError) as error:
        validate_run(typed_config(cfg))
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
