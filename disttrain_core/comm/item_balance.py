"""Item-level rebalancing of an encoder's work across data-parallel ranks (OrchMLLM's idea; docs/UNITS.md).

Each replica of an encoder owns the images, clips or frame groups of its own samples, and their number varies from
replica to replica: the replica with the most sets the encoder's pace. Here, after a microbatch's samples are
assigned, every rank of the encoder's data-parallel group sends some of its items to the ranks with fewer (one
all-to-all), encodes what it then holds, and returns each embedding to the rank the item came from (the inverse
all-to-all). Gradients come back along the same path (comm/all_to_all.py's exchange is differentiable).

The plan is a pure function of every replica's item count, which each rank knows without talking to anyone (the
step's per-sample counts: the broker's, or the producer's summary), so the split sizes are host integers and
nothing is read back from a device. Items of one modality have one shape here, so an item's encoder cost is the
same for all; the plan balances counts, and moves as few items as that allows:

* each replica's target is ``total // n``, the ``total % n`` extra items going to the replicas that hold the most
  (ties: the lower rank), so a replica over its target only sends and one under it only receives;
* a replica keeps the first ``min(count, target)`` of its items and sends the rest, in order, to the replicas under
  their targets in rank order (a greedy flow: deterministic, every moved item moves once).

The order of the items a rank encodes is the all-to-all's (by source rank, its own kept prefix in its own place);
the embeddings return in exactly the order the items left, and the rank puts its kept prefix back in front, so the
result is its own items' embeddings in its own order: slices and one concatenation, no index tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .all_to_all import all_to_all


def balance_targets(counts: Sequence[int]) -> list[int]:
    """Each replica's item count after balancing: ``total // n``, one more for the ``total % n`` replicas that hold
    the most (ties: the lower rank)."""
    n = len(counts)
    total = sum(counts)
    targets = [total // n] * n
    for rank in sorted(range(n), key=lambda r: (-counts[r], r))[: total % n]:
        targets[rank] += 1
    return targets


def balance_moves(counts: Sequence[int]) -> list[list[int]]:
    """``moves[s][d]``: how many items replica ``s`` sends replica ``d`` (``moves[s][s]``: the items it keeps)."""
    counts = [int(c) for c in counts]
    if any(c < 0 for c in counts):
        raise ValueError(f"item counts must not be negative, got {counts}")
    n = len(counts)
    targets = balance_targets(counts)
    moves = [[0] * n for _ in range(n)]
    for rank in range(n):
        moves[rank][rank] = min(counts[rank], targets[rank])
    short = [targets[r] - moves[r][r] for r in range(n)]
    receiver = 0
    for sender in range(n):
        surplus = counts[sender] - moves[sender][sender]
        while surplus:
            while short[receiver] == 0:
                receiver += 1
            amount = min(surplus, short[receiver])
            moves[sender][receiver] += amount
            short[receiver] -= amount
            surplus -= amount
    return moves


@dataclass(frozen=True)
class ItemPlan:
    """One rank's part of a balanced exchange (``moves`` from :func:`balance_moves`, ``rank`` in the group)."""

    moves: tuple[tuple[int, ...], ...]
    rank: int

    @classmethod
    def of(cls, counts: Sequence[int], rank: int) -> ItemPlan:
        return cls(tuple(tuple(row) for row in balance_moves(counts)), rank)

    @property
    def send(self) -> list[int]:
        return list(self.moves[self.rank])

    @property
    def receive(self) -> list[int]:
        return [row[self.rank] for row in self.moves]

    @property
    def moved(self) -> int:
        """Items that change rank, over the whole group."""
        return sum(c for s, row in enumerate(self.moves) for d, c in enumerate(row) if s != d)

    @property
    def largest(self) -> tuple[int, int]:
        """(the most items one replica encodes without balancing, with it)."""
        before = max(sum(row) for row in self.moves)
        after = max(sum(row[d] for row in self.moves) for d in range(len(self.moves)))
        return before, after

    def _split(self) -> tuple[int, int]:
        """(the items this rank keeps, the items it sends to lower ranks): its kept prefix, then its sent items by
        destination rank ascending."""
        return self.moves[self.rank][self.rank], sum(self.send[: self.rank])

    def _outbound_order(self, items: torch.Tensor) -> torch.Tensor:
        """This rank's items grouped by destination rank, ascending: its kept prefix at its own place."""
        kept, lower = self._split()
        return _swap_front(items, kept, lower)

    def _own_order(self, rows: torch.Tensor) -> torch.Tensor:
        """The inverse of ``_outbound_order``, on the outputs returned per item."""
        kept, lower = self._split()
        return _swap_front(rows, lower, kept)

    def encode(self, encode: Callable[[torch.Tensor], torch.Tensor], items: torch.Tensor, group) -> torch.Tensor:
        """``encode(items)`` with the work spread over the group: returns this rank's items' outputs, in order."""
        if items.shape[0] != sum(self.send):
            raise ValueError(f"rank {self.rank} holds {items.shape[0]} items, its plan counts {sum(self.send)}")
        held = all_to_all(self._outbound_order(items), self.send, self.receive, group)
        return self._own_order(all_to_all(encode(held), self.receive, self.send, group))


def _swap_front(rows: torch.Tensor, first: int, second: int) -> torch.Tensor:
    """``rows`` = [A (first rows) | B (second rows) | rest] -> [B | A | rest]; ``rows`` itself when A or B is
    empty."""
    if first == 0 or second == 0:
        return rows
    rest = rows.shape[0] - first - second
    return torch.cat([rows.narrow(0, first, second), rows.narrow(0, 0, first), rows.narrow(0, first + second, rest)])


def moved_bytes(plan: ItemPlan, item_bytes: int, output_bytes: int) -> int:
    """What one balanced encode moves over the group in its forward: the items out and their outputs back (its
    backward moves the outputs' gradients again)."""
    return plan.moved * (item_bytes + output_bytes)


class BalanceLedger:
    """What the balanced encodes of a logging window did, over the whole group (every rank plans every rank's
    part, so each holds the group's totals): items moved, bytes moved forward, and the encoder's critical path --
    the most items one replica encodes, summed over the encodes -- without and with balancing, and the replicas
    that held no item before balancing."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.moved_items = self.moved_bytes = self.largest_before = self.largest_after = self.idle_before = 0

    def add(self, plan: ItemPlan, item_bytes: int, output_bytes: int) -> None:
        before, after = plan.largest
        self.moved_items += plan.moved
        self.moved_bytes += moved_bytes(plan, item_bytes, output_bytes)
        self.largest_before += before
        self.largest_after += after
        self.idle_before += sum(1 for row in plan.moves if not sum(row))  # replicas that held no item

    def metrics(self, steps: int) -> dict[str, float]:
        """Per step over ``steps`` steps, then reset."""
        steps = max(steps, 1)
        out = {
            "balance/moved_items_per_step": self.moved_items / steps,
            "balance/moved_mb_per_step": self.moved_bytes / steps / 2**20,
            "balance/largest_items_before_per_step": self.largest_before / steps,
            "balance/largest_items_after_per_step": self.largest_after / steps,
            "balance/idle_replicas_before_per_step": self.idle_before / steps,
        }
        self.reset()
        return out
