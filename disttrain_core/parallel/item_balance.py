"""Item rebalancing inside the stages that run an encoder (parallel.rebalance_items; comm/item_balance.py): the
image encoder's stage of its own unit, the audio and video towers' stages, and the LLM's first stage where the
encoders are colocated. A stage given an :class:`EncoderBalance` spreads each encode over its data-parallel group;
without one it encodes its own items."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..comm.item_balance import BalanceLedger, ItemPlan
from ..data.batch import Batch

# The Batch fields holding each kind of item (the broker's names: parallel/broker.py).
ITEM_FIELDS = {"image": "images", "clip": "audio", "group": "video"}


@dataclass
class EncoderBalance:
    group: object  # the stage's data-parallel group (one rank per replica, in replica order)
    rank: int  # this replica's index in it
    ledger: BalanceLedger

    def encode(self, kind: str, encode: Callable[[torch.Tensor], torch.Tensor], batch: Batch) -> torch.Tensor:
        items = getattr(batch, ITEM_FIELDS[kind])
        counts = (batch.replica_items or {}).get(kind)
        if counts is None:
            raise RuntimeError(
                "parallel.rebalance_items: this microbatch carries no replica item counts (Batch.replica_items); "
                "the trainer sets them from the step's per-sample counts"
            )
        plan = ItemPlan.of(counts, self.rank)
        out = plan.encode(encode, items, self.group)
        if torch.is_grad_enabled():  # training steps only (validation runs without gradients)
            self.ledger.add(plan, _row_bytes(items), _row_bytes(out))
        return out


def _row_bytes(rows: torch.Tensor) -> int:
    return math.prod(rows.shape[1:]) * rows.element_size()


def encode_items(stage, kind: str, encode: Callable[[torch.Tensor], torch.Tensor], batch: Batch) -> torch.Tensor:
    """``encode`` over the batch's items of ``kind``: balanced over the stage's replicas when it has a balance."""
    balance: EncoderBalance | None = getattr(stage, "item_balance", None)
    if balance is None:
        return encode(getattr(batch, ITEM_FIELDS[kind]))
    return balance.encode(kind, encode, batch)


def replica_items(counts: dict[str, list[list[int]]], k: int, blocks: list[range]) -> dict[str, tuple[int, ...]]:
    """Each replica's items of microbatch ``k`` by kind, from per-sample counts (``CommBroker.counts``) and the
    replicas' sample blocks."""
    return {kind: tuple(sum(per[k][b.start : b.stop]) for b in blocks) for kind, per in counts.items()}
