"""Which context- and expert-parallel sizes the solver tries for the LLM (planner/solver.py enumerates them
with its tp, dp and vpp as ``LlmOption``s; a pipeline size completes one into a ``UnitChoice``).

* cp: powers of two up to 16 that leave every CP rank at least ``min_cp_tokens`` (4096) positions of a
  sequence, and only those. Shorter slices make the ring's K/V blocks too short to hide their exchange
  behind attention, and attention -- the part CP splits that TP and PP cannot split as well -- is then a
  small share of the compute; at such lengths PP, TP, ZeRO and recompute are the cheaper ways to fit
  memory, and leaving CP out keeps the search (and every plan of a short-sequence model) as it was. A
  sequence of 8k tokens may use cp 2, 32k up to cp 8; below 8k, none. When cp = 1 fits no layout of a
  long sequence, the larger sizes are there to fit it (tests/unit/test_planner_cp_ep.py). The cut-off is
  an Orchestrator argument (``planner.cp_min_tokens`` when the config has it) for machines where 4096
  does not hold.
* ep: for a MoE LLM, the divisors of the expert count that also divide dp (EP groups are carved out of
  the data-parallel ranks, parallel/expert_parallel.py); 1 for a dense one, or when the runtime cannot
  run expert parallelism (no ``parallel.units.llm.ep`` yet: ``runtime_has_ep``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from .evaluate import UnitChoice

CP_OPTIONS = (1, 2, 4, 8, 16)
CP_MIN_TOKENS = 4096  # positions of a sequence each context-parallel rank keeps at least (module doc)


@cache
def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def cp_candidates(seq_len: int, options=CP_OPTIONS, min_tokens: int = CP_MIN_TOKENS) -> tuple[int, ...]:
    """The context-parallel sizes worth trying for sequences of ``seq_len`` (module doc); 1 always, and
    only sizes whose 2 cp zig-zag chunks exist."""
    return tuple(c for c in options if c == 1 or (seq_len // c >= min_tokens and seq_len >= 2 * c))


def cp_mode_candidates(cp: int, tp: int, heads: int, kv_heads: int, per_node: int) -> tuple[tuple[str, int], ...]:
    """(parallel.cp_mode, ranks per all-to-all) the solver weighs for ``cp`` ranks at ``tp``: the ring and the
    K/V all-gather always; Ulysses where each rank's heads split over cp (comm/context_modes.py); hybrid with
    the largest all-to-all that splits them and stays inside a node beside TP (tp x u <= per_node)."""
    if cp == 1:
        return (("ring", 1),)
    from ..comm.context_modes import heads_split

    local, local_kv = max(1, heads // tp), max(1, (kv_heads or heads) // tp)
    modes = [("ring", 1), ("allgather", 1)]
    if heads_split(local, local_kv, cp):
        modes.append(("ulysses", cp))
    inner = [u for u in range(cp // 2, 1, -1) if cp % u == 0 and tp * u <= per_node and heads_split(local, local_kv, u)]
    if inner:
        modes.append(("hybrid", inner[0]))
    return tuple(modes)


def ep_candidates(num_experts: int, dp: int) -> tuple[int, ...]:
    """Expert-parallel sizes of a LLM with ``num_experts`` experts (0: dense) and ``dp`` replicas."""
    if not num_experts:
        return (1,)
    return tuple(e for e in divisors(num_experts) if dp % e == 0)


@dataclass(frozen=True)
class LlmOption:
    """The LLM's sizes besides its pipeline: what the solver enumerates, the pipeline it optimizes."""

    tp: int
    dp: int
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    cp_mode: str = "ring"
    cp_ulysses: int = 1

    @property
    def width(self) -> int:
        """Devices per pipeline stage."""
        return self.tp * self.cp * self.dp

    def choice(self, pp: int) -> UnitChoice:
        return UnitChoice(
            self.tp, self.dp, pp, self.vpp, cp=self.cp, ep=self.ep, cp_mode=self.cp_mode, cp_ulysses=self.cp_ulysses
        )
