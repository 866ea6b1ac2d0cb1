"""Uneven pipeline stages: how many LLM blocks each stage holds (``parallel.pp_split``).

The first LLM stage also runs the embedding (and a colocated encoder), the last the final norm, the head with
its loss (and a colocated generator, or the send to the generator unit), so an even split of the blocks leaves
the ends slower than the middle. Megatron (``--decoder-first/last-pipeline-num-layers``) and TorchTitan
(``pipeline_parallel_split_points``) take manual splits; ``pp_split=auto`` balances them from the planner's
costs: each block's forward+backward seconds and the extra seconds at the two ends (``StageCosts``), then the
split that minimizes the slowest stage (``balanced_split``: the linear-partition dynamic program, exact for
this cost model). The planner evaluates pipelines with the same costs and the same splitter (evaluate.py).

A split is a list of block counts, one per LLM pipeline stage in order (pp x virtual stages per rank of them;
virtual stage v of rank r is stage v x pp + r), each at least 1, summing to model.llm.n_layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class StageCosts:
    """Forward + backward seconds per microbatch: one block (``block``), and the extras of the first and last
    LLM stages (``first``, ``last``); ``blocks``: how many blocks."""

    block: float
    first: float
    last: float
    blocks: int
    whole: float = 0.0  # every block and the head together (what an even split spreads over the stages)

    def best(self, stages: int) -> list[int]:
        return balanced_split(self, stages)

    def stage_times(self, split: list[int] | tuple[int, ...]) -> list[float]:
        times = [count * self.block for count in split]
        times[0] += self.first
        times[-1] += self.last
        return times


def balanced_split(costs: StageCosts, stages: int) -> list[int]:
    """The block counts (one per stage, each >= 1) whose slowest stage is fastest; ties go to the split
    whose later stages hold fewer blocks (the last stage also holds the logits)."""
    if not 1 <= stages <= costs.blocks:
        raise ValueError(f"{costs.blocks} blocks cannot fill {stages} pipeline stages (one block each at least)")
    return list(_best(costs, stages))


def _best(costs: StageCosts, stages: int) -> tuple[int, ...]:
    n = costs.blocks

    @cache
    def solve(start: int, left: int) -> tuple[float, tuple[int, ...]]:
        """The best (slowest stage, counts) for blocks[start:] over ``left`` stages."""
        remaining = n - start
        first = costs.first if start == 0 else 0.0
        if left == 1:
            return first + remaining * costs.block + costs.last, (remaining,)
        best = None
        for count in range(remaining - left + 1, 0, -1):  # more blocks early first: the tie rule above
            here = first + count * costs.block
            rest, counts = solve(start + count, left - 1)
            value = max(here, rest)
            if best is None or value < best[0] - 1e-12 * max(1.0, value):
                best = (value, (count, *counts))
        return best

    return solve(0, stages)[1]


def per_rank_times(stage_times: list[float], pp: int) -> list[float]:
    """Seconds per microbatch of each pipeline rank: the sum of its virtual stages (stage v x pp + r)."""
    return [sum(stage_times[r::pp]) for r in range(pp)]
