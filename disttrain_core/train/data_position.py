"""Carry a data position across a change of data-parallel size.

The stream is canonical (docs/DATA.md): in epoch *e*, replica *r* of *D* reads every *D*-th shard
from *r* interleaved, so when every shard holds the same number of samples and *D* divides the
shard count, replica *r*'s *l*-th element is element *lD + r* of the one global order. A
checkpoint whose *D* replicas all stand at index *I* of epoch *e* has therefore consumed exactly
the first *C = I·D* elements; a layout with *D'* replicas continues exactly from *C / D'* each,
when *D'* divides *C* and the shard count. Otherwise the nearest exact position before it is
used -- the largest multiple of *D'* not past any replica, or the epoch's start when the shards
make no exact mapping -- and one line says how many elements are read again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Carried:
    states: list[dict]  # one per new replica stream (one for the global stream)
    message: str | None  # what changed, for the log (None: nothing to say)
    exact: bool


def _totals(states: list[dict]) -> dict:
    skipped: dict[str, int] = {}
    for state in states:
        for reason, count in state.get("skipped", {}).items():
            skipped[reason] = skipped.get(reason, 0) + int(count)
    return {"skipped": skipped, "truncated_images": sum(int(s.get("truncated_images", 0)) for s in states)}


def carry(saved: list[dict], replicas: int, shard_counts: list[int] | None) -> Carried:
    """``saved``: the checkpoint's positions, one per replica stream (in replica order); ``replicas``: the
    new number of streams; ``shard_counts``: samples per shard (None when not counted)."""
    old = len(saved)
    if old == replicas:
        return Carried([dict(s) for s in saved], None, True)
    totals = _totals(saved)

    def streams(epoch: int, index: int) -> list[dict]:
        # counters are run totals: the first stream carries them (their sum is what is logged)
        return [
            {"epoch": epoch, "index": index, **(totals if r == 0 else {"skipped": {}, "truncated_images": 0})}
            for r in range(replicas)
        ]

    epochs = {int(s["epoch"]) for s in saved}
    epoch = min(epochs)
    shards = len(shard_counts) if shard_counts else 0
    even = bool(shard_counts) and len(set(shard_counts)) == 1 and shards % old == 0 and shards % replicas == 0
    if len(epochs) > 1 or not even:
        why = (
            "the replicas stood in different epochs"
            if len(epochs) > 1
            else f"{shards} shards ({'unequal' if shard_counts and len(set(shard_counts)) > 1 else 'equal'} sizes) "
            f"do not map {old} and {replicas} replica streams onto one order"
        )
        consumed = sum(int(s["index"]) for s in saved if int(s["epoch"]) == epoch)
        return Carried(
            streams(epoch, 0),
            f"data position: {why}; {replicas} stream(s) restart epoch {epoch} from its start "
            f"(about {consumed} elements of it are read again)",
            False,
        )
    indexes = [int(s["index"]) for s in saved]
    consumed = min(indexes) * old  # the prefix every replica has passed
    exact_prefix = consumed - consumed % replicas
    exact = len(set(indexes)) == 1 and exact_prefix == consumed
    ahead = sum(indexes) - exact_prefix
    message = (
        f"data position: {old} -> {replicas} replica stream(s), continuing exactly after element {consumed} of epoch "
        f"{epoch}"
        if exact
        else f"data position: {old} -> {replicas} replica stream(s) has no exact mapping; continuing after element "
        f"{exact_prefix} of epoch {epoch} ({ahead} elements are read again)"
    )
    return Carried(streams(epoch, exact_prefix // replicas), message, exact)
