"""The schedule representation: per-rank lists of actions.

An action is written like torch.distributed.pipelining writes it:
``{stage}{kind}{microbatch}`` -- ``0F1`` (stage 0 forward of microbatch 1), ``1B0``
(full backward), ``0I2`` (backward for the input only), ``0W2`` (backward for the
weights only), and the communication actions ``2SEND_F1``, ``3RECV_B0``. A schedule
is one list per rank; ``None`` is an explicit idle slot (kept for CSV round trips,
ignored by execution and simulation, which follow dependencies, not slots).

CSV files use torch's ``compute_only`` layout: one row per rank, one action per
cell, empty cells for idle slots.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path


class Kind(str, Enum):
    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # noqa: E741  backward for the input gradient only
    W = "W"  # backward for the weight gradients only (after I)
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)
_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION.match(text.strip())
        if not match:
            raise ValueError(f"{text!r} is not an action; expected e.g. 0F1, 1B0, 0I2, 0W2, 2SEND_F1")
        return cls(int(match.group(1)), Kind(match.group(2)), int(match.group(3)))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


@dataclass
class Schedule:
    """Per-rank action lists plus the stage -> rank placement they assume."""

    name: str
    num_microbatches: int
    stage_to_rank: list[int]
    actions: list[list[Action | None]]
    meta: dict = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a is not None and a.is_compute]

    @property
    def forward_only(self) -> frozenset[int]:
        """Stages that run forwards only (frozen modules with nothing trainable before them: ``drop_backward``)."""
        return frozenset(self.meta.get("forward_only", ()))

    def uses_split_backward(self) -> bool:
        return any(a is not None and a.kind in (Kind.I, Kind.W) for row in self.actions for a in row)

    def format(self) -> str:
        width = max((len(str(a)) for row in self.actions for a in row if a is not None), default=3)
        return "\n".join(
            f"rank {rank}: " + " ".join(str(a).rjust(width) if a else "-".rjust(width) for a in row)
            for rank, row in enumerate(self.actions)
        )

    # ----------------------------------------------------------------- CSV
    def to_csv(self, path: str | Path) -> None:
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            for row in self.actions:
                writer.writerow([str(a) if a is not None else "" for a in row])

    @classmethod
    def from_csv(cls, path: str | Path, num_microbatches: int | None = None, name: str | None = None) -> Schedule:
        """Read a compute-only CSV; the stage placement is inferred from which row holds each stage."""
        with open(path, newline="") as handle:
            rows = [[Action.parse(cell) if cell.strip() else None for cell in row] for row in csv.reader(handle)]
        stage_rank: dict[int, int] = {}
        for rank, row in enumerate(rows):
            for action in row:
                if action is None:
                    continue
                if stage_rank.setdefault(action.stage, rank) != rank:
                    raise ValueError(
                        f"{path}: stage {action.stage} appears on ranks {stage_rank[action.stage]} "
                        f"and {rank}; a stage lives on one rank"
                    )
        stages = sorted(stage_rank)
        if stages != list(range(len(stages))):
            raise ValueError(f"{path}: stages must be numbered 0..N-1, found {stages}")
        microbatches = 1 + max(a.microbatch for row in rows for a in row if a is not None)
        return cls(name or Path(path).stem, num_microbatches or microbatches, [stage_rank[s] for s in stages], rows)


def drop_backward(schedule: Schedule, stages: int) -> Schedule:
    """The schedule with the first ``stages`` stages forward-only: their backward actions (B, I, W) removed, and
    no gradient sent to them (transfers.py reads ``Schedule.forward_only``). For stages whose modules are all
    frozen and that have no trainable stage before them (Cornstarch's frozen-aware pipeline): a backward there
    computes nothing, yet in 1F1B it holds the stage's next forward back until the gradient arrives."""
    if stages <= 0:
        return schedule
    if stages >= schedule.num_stages:
        raise ValueError(f"{stages} forward-only stages of {schedule.num_stages}: some stage must train")
    actions = [
        [a for a in row if a is None or not a.is_compute or a.kind == Kind.F or a.stage >= stages]
        for row in schedule.actions
    ]
    meta = {**schedule.meta, "forward_only": tuple(range(stages))}
    return Schedule(schedule.name, schedule.num_microbatches, list(schedule.stage_to_rank), actions, meta)
