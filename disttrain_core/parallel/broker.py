"""The communication broker's routing: which rows of a boundary tensor go from
which rank to which, between consecutive pipeline stages -- inside a unit, or
across units whose data- and tensor-parallel sizes differ, and between the LLM
and a *branch group* of units side by side (units.py: the encoder units all feed
the LLM's first stage; the LLM's last stage feeds every generator unit).

Rows are samples (LLM hidden states, generation queries), images (inside the
image encoder), or embedding tokens (an encoder unit's output: ``per_item`` rows per
image, clip or video frame group). Sender replica ``a`` of unit A and receiver replica ``b`` of unit B
exchange the rows of the samples both own: the intersection of their contiguous
blocks (see units.py), so each sample's embeddings go straight to the replica that
needs them and their gradients come straight back -- point to point, no gather
through one rank. Across tensor-parallel groups (activations are replicated inside a
TP group) receiver TP rank ``j`` takes its copy from sender TP rank ``j mod tp_A``,
and on the way back sender TP rank ``i`` takes the gradient from receiver TP rank
``i mod tp_B``: every rank gets what it needs from exactly one peer. Empty pieces (a
microbatch block without images) are not sent at all.

Branch groups. The LLM's side of a boundary with a branch group holds one *section*
per unit of the group, in the group's order, each laid out as that unit's own tensor
(the image embeddings of the LLM replica's samples, then their clips' embeddings; the
generation queries once per generator unit); a piece names its section, so the
receiving stage can split what arrives. Each unit of the group sees only its own
section.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..data.batch import ITEM_COUNTS
from .units import ParallelismUnit

ACT, GRAD = "act", "grad"


@dataclass(frozen=True)
class Piece:
    rank: int  # the peer
    rows: range  # rows of this side's tensor
    section: int = 0  # the branch unit's section of the LLM's side of the boundary (0 elsewhere)


@dataclass(frozen=True)
class RowKind:
    """How a tensor's rows map to samples: one per sample (``counts`` None), or ``per_item`` rows per item of a
    per-sample count (``image``, ``clip``, ``group``: a video's frame group)."""

    counts: str | None = None
    per_item: int = 1


SAMPLE_ROWS = RowKind()

Place = tuple[ParallelismUnit, int]  # (unit, pipeline index inside the unit)


class CommBroker:
    """Routing for one schedule.

    ``stage_places[s]`` lists the (unit, pipeline index inside the unit) running schedule stage ``s`` (several
    for a branch group); ``row_places[r]`` the same for schedule row ``r`` (rows and stages differ only for
    virtual stages); ``row_kinds[s][i]`` is how the rows of section ``i`` of the tensor leaving stage ``s``
    map to samples (one section unless one side of the boundary is a branch group).
    """

    def __init__(
        self,
        stage_places: list[list[Place]],
        row_places: list[list[Place]],
        row_kinds: list[list[RowKind]],
        samples_per_microbatch: int,
    ):
        self.stage_places = stage_places
        self.row_places = row_places
        self.row_kinds = row_kinds
        self.samples = samples_per_microbatch
        self.counts: dict[str, list[list[int]]] = {}  # kind -> per microbatch, per sample of the global one
        self._memo: dict[tuple, tuple[Piece, ...]] = {}  # _pieces' answers: a schedule asks each many times

    def set_counts(
        self,
        image_counts: list[list[int]],
        clip_counts: list[list[int]] | None = None,
        group_counts: list[list[int]] | None = None,
    ) -> None:
        """Per microbatch, each sample's images, clips and video frame groups (clips and groups default to none)."""
        none = [[0] * len(counts) for counts in image_counts]
        self.counts = {"image": image_counts, "clip": clip_counts or none, "group": group_counts or none}
        self._memo.clear()

    def count_items(self, microbatches) -> None:
        """``set_counts`` from a step's microbatches (Batch: their image, clip and frame-group counts per row)."""
        self.set_counts(*([getattr(mb, name).tolist() for mb in microbatches] for name in ITEM_COUNTS))

    def ranks_of_row(self, row: int) -> list[int]:
        return [
            unit.rank_at(d, i, pp)
            for unit, pp in self.row_places[row]
            for d in range(unit.dp)
            for i in range(unit.inner)
        ]

    def _rows(self, samples: range, block: range, kind: RowKind, k: int) -> range:
        """Rows of ``samples`` (a sub-range of ``block``) in a tensor holding ``block``'s rows of ``kind``."""
        if kind.counts is None:
            return range(samples.start - block.start, samples.stop - block.start)
        counts = self.counts[kind.counts][k]
        start = sum(counts[block.start : samples.start]) * kind.per_item
        return range(start, start + sum(counts[samples.start : samples.stop]) * kind.per_item)

    def _pieces(self, boundary: int, senders: list[Place], receivers: list[Place], k: int, rank: int, sending: bool):
        """Pieces between ``rank`` (a sender if ``sending``, else a receiver) and its peers across the boundary
        after stage ``boundary``. Only rows counted per image or clip depend on the microbatch ``k``: other
        answers are remembered per boundary and rank."""
        kinds = self.row_kinds[boundary]
        counted = any(kind.counts is not None for kind in kinds)
        key = (boundary, id(senders), id(receivers), k if counted else None, rank, sending)
        pieces = self._memo.get(key)
        if pieces is None:
            pieces = self._memo[key] = self._find_pieces(senders, receivers, kinds, k, rank, sending)
        return pieces

    def _find_pieces(self, senders, receivers, kinds, k: int, rank: int, sending: bool) -> tuple[Piece, ...]:
        """Receiver inner position ``j`` always listens to sender position ``j mod inner_sender`` (tp ranks, with
        context parallelism ``cp * tp + tp_rank``, units.py: between stages of one unit CP rank c talks to CP
        rank c, the sequence slices stay where they are)."""
        mine_side, other_side = (senders, receivers) if sending else (receivers, senders)
        me, me_pp = next(place for place in mine_side if rank in place[0].ranks)
        # (section, the rows' kind, the peer place); ``fan``: this side is the LLM's, holding every section
        fan = len(other_side) > 1 and len(mine_side) == 1
        if len(mine_side) > 1 and len(other_side) > 1:  # inside a branch group: each unit with itself
            links = [(0, kinds[i], place) for i, place in enumerate(other_side) if place[0] is me]
        elif fan:  # the LLM's side: a section per unit of the group
            links = [(i, kinds[i], place) for i, place in enumerate(other_side)]
        else:  # one unit across (a branch unit sees only its section)
            i = next(i for i, place in enumerate(mine_side) if place[0] is me)
            links = [(i if len(mine_side) > 1 else 0, kinds[i], other_side[0])]
        d, _, _ = me.coords(rank)
        t = me.inner_index(rank)
        mine = me.block(d, self.samples)
        pieces = []
        for section, kind, (other, other_pp) in links:
            offset = 0
            if fan:  # the LLM's sections before this one, for its own samples
                offset = sum(len(self._rows(mine, mine, kinds[j], k)) for j in range(section))
            for o in range(other.dp):
                theirs = other.block(o, self.samples)
                shared = range(max(mine.start, theirs.start), min(mine.stop, theirs.stop))
                rows = self._rows(shared, mine, kind, k) if shared else range(0)
                if not rows:
                    continue
                rows = range(rows.start + offset, rows.stop + offset)
                src, dst = (me, other) if sending else (other, me)
                if sending:
                    pieces += [
                        Piece(dst.rank_at(o, j, other_pp), rows, section)
                        for j in range(dst.inner)
                        if j % src.inner == t
                    ]
                else:
                    pieces.append(Piece(src.rank_at(o, t % src.inner, other_pp), rows, section))
        return tuple(sorted(pieces, key=lambda piece: (piece.rows.start, piece.rank)))

    def outgoing(self, kind: str, stage: int, k: int, rank: int) -> tuple[Piece, ...]:
        """Pieces ``rank`` sends after running ``stage`` (ACT: to stage+1; GRAD: to stage-1)."""
        target = stage + 1 if kind == ACT else stage - 1
        boundary = stage if kind == ACT else target  # the boundary lies after this stage
        return self._pieces(boundary, self.stage_places[stage], self.stage_places[target], k, rank, sending=True)

    def incoming(self, kind: str, stage: int, k: int, rank: int) -> tuple[Piece, ...]:
        """Pieces ``rank`` (running ``stage``) receives, in row order (ACT from stage-1, GRAD from stage+1)."""
        source = stage - 1 if kind == ACT else stage + 1
        boundary = source if kind == ACT else stage
        return self._pieces(boundary, self.stage_places[source], self.stage_places[stage], k, rank, sending=False)
