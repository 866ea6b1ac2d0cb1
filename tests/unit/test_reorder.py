"""Intra- and inter-microbatch reordering (data/reorder.py): exactness, balance, pipeline time."""

import random
import statistics

import numpy as np
import pytest

from disttrain_core.data.reorder import (
    arrange,
    balanced_partition,
    brute_force_partition,
    canonical_groups,
    group_loads,
    order_slots_checked,
    simulated_makespan,
    slot_costs,
)


def laion_like_costs(rng: np.random.Generator, n: int) -> list[float]:
    """Encoder work per sample: images ~ geometric(0.45) truncated at 8, 5% text-only."""
    images = np.minimum(rng.geometric(0.45, size=n), 8) * (rng.random(n) > 0.05)
    return [float(x) + 0.05 for x in images]  # + the LLM's share, equal for every sample


def test_greedy_partition_stays_within_four_thirds_of_the_optimum():
    rng = random.Random(0)
    ratios = []
    for _ in range(150):
        groups = rng.choice([2, 3, 4])
        n = groups * rng.choice([2, 3])
        costs = [rng.choice([1, 1, 2, 3, 5, 8]) + rng.random() for _ in range(n)]
        members = balanced_partition(costs, groups)
        assert sorted(i for g in members for i in g) == list(range(n))
        assert {len(g) for g in members} == {n // groups}
        ratios.append(max(group_loads(costs, members)) / brute_force_partition(costs, groups))
    assert max(ratios) <= 4 / 3
    assert min(ratios) >= 1 - 1e-12
    print(f"greedy / optimum: mean {statistics.mean(ratios):.4f}, max {max(ratios):.4f}")


def test_reordering_keeps_the_samples_of_the_step_and_balances_every_unit():
    rng = np.random.default_rng(1)
    slots, per_slot = 8, 6
    groups = canonical_groups([2, 3], per_slot)  # encoder dp 2, LLM dp 3 -> a grid of 6
    costs = laion_like_costs(rng, slots * per_slot)
    order = arrange(costs, slots, per_slot, groups, stages=3)
    assert sorted(order) == list(range(len(costs)))  # same samples, new order only

    def replica_loads(order, dp):
        block = per_slot // dp
        loads = [0.0] * dp
        for position, i in enumerate(order):
            loads[(position % per_slot) // block] += costs[i]
        return loads

    for dp in (2, 3):
        before, after = replica_loads(list(range(len(costs))), dp), replica_loads(order, dp)
        assert max(after) / np.mean(after) <= max(before) / np.mean(before) + 1e-9
        assert max(after) / np.mean(after) < 1.05


def straggler(costs, order, groups):
    """Largest over mean DP-group load when the grid has ``groups`` groups per slot."""
    loads = np.asarray([costs[i] for i in order]).reshape(-1, groups).sum(axis=0)
    return loads.max() / loads.mean()


def test_intra_reordering_shrinks_the_straggler_on_skewed_batches():
    rng = np.random.default_rng(2)
    worse = 0
    for _ in range(20):
        costs = laion_like_costs(rng, 256)
        plain = arrange(costs, 16, 16, 16, intra=False, inter=False)
        balanced = arrange(costs, 16, 16, 16, inter=False)
        worse += straggler(costs, balanced, 16) > straggler(costs, plain, 16)
        assert straggler(costs, balanced, 16) < 1.1
    assert worse == 0


def test_inter_reordering_never_lengthens_the_simulated_pipeline():
    rng = np.random.default_rng(3)
    gains = []
    for stages in (2, 4, 8):
        for slots in (8, 16, 32):
            for _ in range(5):
                costs = laion_like_costs(rng, slots * 4)
                order = arrange(costs, slots, 4, 1, stages=stages, intra=False, inter=False)
                per_slot = slot_costs(costs, order, slots, 1)
                period = float(np.mean(per_slot))
                chosen = order_slots_checked(per_slot, stages, period)
                before = simulated_makespan(per_slot, list(range(slots)), stages, period)
                after = simulated_makespan(per_slot, chosen, stages, period)
                assert after <= before * (1 + 1e-12)
                gains.append(before / after)
    assert statistics.mean(gains) > 1.005  # it does help on average, not just never hurt


def test_grid_must_divide_the_slot():
    with pytest.raises(ValueError, match="lcm 6"):
        canonical_groups([2, 3], 8)
