"""``data.producer.count`` and its addresses: a pool of producers, each serving whole data-parallel groups of every
microbatch slot (data/producer_assembly.py)."""

from __future__ import annotations

from ..config import Config
from .common import _require


def check_pool_settings(p, addresses: list[str]) -> None:
    """data.producer.count against the addresses, the listen port and per_rank (the layout's groups: layout.py)."""
    _require(p.count >= 1, f"data.producer.count={p.count}: use 1 or more producers")
    _require(p.restarts >= 0, f"data.producer.restarts={p.restarts}: use 0 (never start a dead producer again) or more")
    if addresses:
        _require(
            p.count in (1, len(addresses)),
            f"data.producer.count={p.count} but data.producer.address names {len(addresses)} producer(s): the pool "
            "is the producers the address lists; drop data.producer.count",
        )
    size = len(addresses) or p.count
    if size > 1:
        _require(
            bool(p.per_rank),
            f"a pool of {size} producers serves each trainer its own samples: data.producer.per_rank=false (every "
            "trainer the whole batch) needs one producer",
        )
    if p.count > 1 and not addresses:
        _require(
            p.workers >= 1,
            f"data.producer.count={p.count} starts producers only with data.producer.workers>=1 (0 decodes in the "
            "trainers, without producers)",
        )
        _require(
            str(p.listen).rpartition(":")[2] == "0",
            f"data.producer.listen={p.listen}: {p.count} producers on one host need port 0 (each takes a free one)",
        )


def check_producer_pool(cfg: Config, layout) -> None:
    """At most one producer per data-parallel group (each serves whole groups of every slot, data/reorder.py)."""
    import math

    p = cfg.data.producer
    if p.address is None and p.workers == 0:
        return
    from ..data.producer_client import pool_addresses

    size = len(pool_addresses(p.address)) or int(p.count)
    groups = math.lcm(*(unit.dp for unit in layout.units))
    _require(
        size <= groups,
        f"data.producer.count={size}: a pool serves whole data-parallel groups, and this layout has {groups} "
        f"({_dps(layout)}); use at most {groups} producers",
    )


def _dps(layout) -> str:
    return ", ".join(f"{', '.join(unit.modules)} dp={unit.dp}" for unit in layout.units)
