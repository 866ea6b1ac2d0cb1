"""``trainer.fault_tolerance``: per-step fault tolerance over replica groups on torchft (docs/FAULT_TOLERANCE.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class FaultToleranceConfig:
    enabled: bool = False
    # Replica groups: trainer.devices processes are split into this many groups of equal size, each an ordinary
    # data-parallel run (DDP inside the group); a group that fails is left out of the next step's quorum.
    replicas: int = 2
    # Groups a step needs to commit; null: a majority (replicas // 2 + 1). Fewer than a majority is refused: two
    # halves of a partitioned job could each commit a different model.
    min_replicas: Optional[int] = None
    # host:port of a running torchft Lighthouse (a cluster's); null: train.py starts one on `bind`.
    lighthouse: Optional[str] = None
    # Restart a group that dies; it joins a later quorum and receives the state from a healthy group.
    replace: bool = True
    # How long the launcher waits before starting a group that died again (0: at once; tests withhold it).
    replace_delay_s: float = 0.0
    # A group replaced this many times is given up on (a fault that comes back at once is not a transient one).
    max_replacements: int = 10
    # A replacement that has not joined a quorum this long after its group died is given up on: the job goes on
    # with the groups that remain (1..86400).
    replace_timeout_s: float = 300.0
    # Seconds for a step's fault-tolerant collectives, commit vote and state transfer before torchft calls it failed.
    timeout_s: float = 30.0
    quorum_timeout_s: float = 120.0  # how long a group waits for a quorum
    # The Lighthouse forms a quorum this long after the first group asks even if a healthy group has not asked yet
    # (a slow group left out of a step is healed at the next one).
    join_timeout_ms: int = 5000
    heartbeat_timeout_ms: int = 5000  # a group silent this long is left out
    # The address the Lighthouse, each group's Manager server and its state server listen on and advertise.
    bind: str = "127.0.0.1"
    # The key that authenticates state transfers between groups (hex:<hex>, file:<path> or text of 16+ bytes);
    # null: a fresh one per job (groups started by one train.py). Groups started separately need the same one.
    key: Optional[str] = None


def quorum_minimum(ft) -> int:
    """The groups a step needs to commit: ``min_replicas``, or a majority of ``replicas`` when it is null."""
    return ft.min_replicas if ft.min_replicas is not None else majority(ft.replicas)


def majority(replicas: int) -> int:
    return replicas // 2 + 1
