"""trainer.straggler: the emulated slow rank busy-works (factor - 1) x its step's CPU time."""

import time

from omegaconf import OmegaConf

from disttrain_core.config import StragglerConfig
from disttrain_core.train.straggler import Straggler


def _cfg(**values):
    return OmegaConf.structured(StragglerConfig(**values))


def _spin(seconds: float) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_a_slow_rank_works_factor_minus_one_times_its_step_cpu_time():
    slow = Straggler(_cfg(ranks=[1], factor=2.0), rank=1)
    slow.start()
    _spin(0.05)
    cpu_before = time.thread_time()
    wall = time.perf_counter()
    extra = slow.delay(step=1)
    wall = time.perf_counter() - wall
    busy = time.thread_time() - cpu_before
    assert 0.05 <= extra < 0.5
    assert wall >= extra
    assert busy > 0.5 * extra  # work, not a sleep: the time was spent on the CPU


def test_other_ranks_and_factor_one_are_untouched():
    assert Straggler(_cfg(ranks=[1], factor=2.0), rank=0).delay(1) == 0.0
    assert Straggler(_cfg(ranks=[0], factor=1.0), rank=0).delay(1) == 0.0


def test_random_slowdowns_are_drawn_per_step_and_repeatable():
    a = Straggler(_cfg(ranks=[0], probability=0.3, seed=7), rank=0)
    b = Straggler(_cfg(ranks=[0], probability=0.3, seed=7), rank=0)
    draws = [a.slow(step) for step in range(1, 2001)]
    assert draws == [b.slow(step) for step in range(1, 2001)]
    assert 0.25 < sum(draws) / len(draws) < 0.35
