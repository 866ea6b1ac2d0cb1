"""Hot-switch plans: how to move parameters (or accumulated gradients) from one parallel strategy's layout
to another's, computed identically on every rank from the two layouts alone (no negotiation).

HotSPa (seed 001) runs each length bucket of a step under its own strategy over one set of model states,
so the states move between layouts inside a step. The plan follows the public implementation's
``NEW_GREEDY`` switcher (shared/reference/algorithms.md, 1.2), written out here for boxes:

1. **Finest common slicing.** A layout gives every rank the box (a start/stop per dimension) it holds of
   each parameter, or nothing (another pipeline stage's layer). Along each dimension the cut points of
   both layouts' boxes are merged; the slices are the cells of that grid (for even splits into n and m
   parts this is the lcm(n, m) slicing). A slice's *owners* hold it before, its *receivers* need it after.
2. **One sender per (slice, receiver).** A receiver that owns the slice copies it locally. Otherwise the
   sender is an owner on the receiver's node if there is one, else any owner; among those, the one that
   has sent the fewest bytes of slices with the same owner set, then the fewest bytes overall, then the
   lowest rank. Without a node preference this is list scheduling per owner set, so no rank sends more
   than ceil(bytes of the set / owners) + the largest slice of the set (tests check it); the node
   preference trades that balance for intra-node links, as HotSPa does.
3. **Fusion.** All slices from one sender to one receiver travel as one buffer, in plan order; each rank
   posts all its sends and receives as one batched call (parallel/hot_switch.py runs a plan).

Strategies. ``strategy_layout`` derives the boxes of a (dp, tp, pp) strategy for named parameters from
where each lives (``ParamSpec``: its shape, the dimension tensor parallelism splits or None, and the
pipeline stage that holds it, as a fraction of the layer stack). Ranks are ordered tp fastest, then cp,
dp and pp, as in units.py; context-parallel ranks hold whole parameters, like data-parallel replicas.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension


@dataclass(frozen=True)
class Strategy:
    """A (dp, tp, pp, cp) strategy of ``dp * tp * pp * cp`` ranks; ``name`` like ``dp2tp2``."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    FACTORS = ("dp", "tp", "pp", "cp")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def name(self) -> str:
        parts = [f"{k}{getattr(self, k)}" for k in self.FACTORS if getattr(self, k) > 1]
        return "".join(parts) or "dp1"

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """``dp2tp2``, ``tp2pp2``, ``cp2dp2``, ...: factors in any order, each at most once, absent ones 1."""
        found = re.fullmatch(r"((dp|tp|pp|cp)[1-9][0-9]*)+", str(text))
        sizes = {k: int(v) for k, v in re.findall(r"(dp|tp|pp|cp)([0-9]+)", str(text))} if found else {}
        if not found or len(re.findall(r"(dp|tp|pp|cp)", str(text))) != len(sizes):
            raise ValueError(f"strategy {text!r}: write it as factors like dp2tp2, tp2pp2 or cp2dp2 (each once)")
        return cls(**sizes)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, tp, pp) index of ``rank``: tp fastest, then cp, dp, pp (units.py's order)."""
        inner = self.tp * self.cp
        return (rank // inner) % self.dp, rank % self.tp, rank // (inner * self.dp)

    def cp_index(self, rank: int) -> int:
        return (rank // self.tp) % self.cp


@dataclass(frozen=True)
class ParamSpec:
    """Where a parameter lives: ``shape``; ``tp_dim`` the dimension tensor parallelism splits (None:
    replicated over tp); ``layer`` its decoder layer (None: ``edge`` says first or last stage)."""

    shape: tuple[int, ...]
    tp_dim: int | None = None
    layer: int | None = None
    edge: str = "first"  # "first" | "last", for parameters outside the layer stack


def stage_of(spec: ParamSpec, layers: int, pp: int) -> int:
    if spec.layer is None:
        return 0 if spec.edge == "first" else pp - 1
    if layers % pp:
        raise ValueError(f"{layers} layers cannot be split evenly over pp={pp} stages")
    return spec.layer // (layers // pp)


def strategy_layout(specs: dict[str, ParamSpec], strategy: Strategy, layers: int) -> dict[str, dict[int, Box]]:
    """Every rank's box of every parameter under ``strategy`` (ranks of other stages hold nothing)."""
    layout: dict[str, dict[int, Box]] = {}
    for name, spec in specs.items():
        stage = stage_of(spec, layers, strategy.pp)
        boxes = {}
        for rank in range(strategy.world):
            _, t, p = strategy.coords(rank)
            if p != stage:
                continue
            box = [(0, n) for n in spec.shape]
            if spec.tp_dim is not None and strategy.tp > 1:
                size = spec.shape[spec.tp_dim]
                if size % strategy.tp:
                    raise ValueError(f"{name}: dimension {spec.tp_dim} ({size}) does not divide by tp={strategy.tp}")
                part = size // strategy.tp
                box[spec.tp_dim] = (t * part, (t + 1) * part)
            boxes[rank] = tuple(box)
        layout[name] = boxes
    return layout


@dataclass(frozen=True)
class Transfer:
    name: str
    box: Box
    sender: int
    receiver: int
    numel: int


@dataclass
class SwitchPlan:
    """Local copies and transfers of one switch; ``messages[(sender, receiver)]`` in plan order."""

    local: list[Transfer] = field(default_factory=list)  # sender == receiver
    messages: dict[tuple[int, int], list[Transfer]] = field(default_factory=dict)

    def transfers(self) -> list[Transfer]:
        return [t for pair in sorted(self.messages) for t in self.messages[pair]]

    def sent(self, rank: int) -> int:
        """Elements ``rank`` sends."""
        return sum(t.numel for (s, _), ts in self.messages.items() if s == rank for t in ts)

    def received(self, rank: int) -> int:
        return sum(t.numel for (_, r), ts in self.messages.items() if r == rank for t in ts)

    def peers(self, rank: int) -> tuple[list[int], list[int]]:
        """(ranks ``rank`` sends to, ranks it receives from), ascending."""
        to = sorted(r for s, r in self.messages if s == rank)
        frm = sorted(s for s, r in self.messages if r == rank)
        return to, frm

    def moved(self) -> int:
        """Elements that travel between processes (local copies not counted)."""
        return sum(t.numel for ts in self.messages.values() for t in ts)

    def message_numel(self, sender: int, receiver: int) -> int:
        return sum(t.numel for t in self.messages.get((sender, receiver), []))

    @property
    def largest_message(self) -> int:
        return max((self.message_numel(*pair) for pair in self.messages), default=0)


def _cuts(boxes: list[Box], dims: int) -> list[list[int]]:
    return [sorted({edge for box in boxes for edge in box[d]}) for d in range(dims)]


def _contains(box: Box, cell: Box) -> bool:
    return all(b0 <= c0 and c1 <= b1 for (b0, b1), (c0, c1) in zip(box, cell, strict=True))


def slices(shape: tuple[int, ...], src: dict[int, Box], dst: dict[int, Box]) -> list[tuple[Box, list[int], list[int]]]:
    """The finest common slicing of one parameter: (cell, owners, receivers) in row-major order, for the
    cells some receiver needs."""
    boxes = list(src.values()) + list(dst.values()) + [tuple((0, n) for n in shape)]
    cuts = _cuts(boxes, len(shape))
    out = []
    for cell in itertools.product(*[list(zip(c[:-1], c[1:], strict=True)) for c in cuts]):
        receivers = [r for r, box in sorted(dst.items()) if _contains(box, cell)]
        if not receivers:
            continue
        owners = [r for r, box in sorted(src.items()) if _contains(box, cell)]
        if not owners:
            raise ValueError(f"slice {cell} is needed by ranks {receivers} but held by no rank before the switch")
        out.append((tuple(cell), owners, receivers))
    return out


def plan_switch(
    shapes: dict[str, tuple[int, ...]],
    src: dict[str, dict[int, Box]],
    dst: dict[str, dict[int, Box]],
    node_of=None,
) -> SwitchPlan:
    """The plan moving every parameter of ``shapes`` from layout ``src`` to ``dst`` (see the module doc).
    ``node_of(rank)``: the node of a rank (None: one node)."""
    node_of = node_of or (lambda rank: 0)
    plan = SwitchPlan()
    by_set: dict[tuple, dict[int, int]] = {}  # owner set -> rank -> elements sent from it
    total: dict[int, int] = {}
    for name in sorted(shapes):
        for cell, owners, receivers in slices(tuple(shapes[name]), src[name], dst[name]):
            numel = math.prod(b - a for a, b in cell)
            loads = by_set.setdefault(tuple(owners), {})
            for receiver in receivers:
                if receiver in owners:
                    plan.local.append(Transfer(name, cell, receiver, receiver, numel))
                    continue
                near = [o for o in owners if node_of(o) == node_of(receiver)] or owners
                sender = min(near, key=lambda o: (loads.get(o, 0), total.get(o, 0), o))
                loads[sender] = loads.get(sender, 0) + numel
                total[sender] = total.get(sender, 0) + numel
                plan.messages.setdefault((sender, receiver), []).append(Transfer(name, cell, sender, receiver, numel))
    return plan


class PlanCache:
    """Plans per (from, to) strategy: a switch between two strategies is planned once."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], layouts: dict[str, dict[str, dict[int, Box]]], node_of=None):
        self.shapes, self.layouts, self.node_of = shapes, layouts, node_of
        self.plans: dict[tuple[str, str], SwitchPlan] = {}

    def get(self, source: str, target: str) -> SwitchPlan:
        key = (source, target)
        if key not in self.plans:
            self.plans[key] = plan_switch(self.shapes, self.layouts[source], self.layouts[target], self.node_of)
        return self.plans[key]
