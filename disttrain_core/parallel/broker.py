"""The communication broker's routing: which rows of a boundary tensor go from
which rank to which, between consecutive pipeline stages -- inside a unit, or
across units whose data- and tensor-parallel sizes differ.

Rows are samples (LLM hidden states, generation queries) or images (encoder
activations and embeddings). Sender replica ``a`` of unit A and receiver replica
``b`` of unit B exchange the rows of the samples both own: the intersection of
their contiguous blocks (see units.py), so each sample's embeddings go straight
to the replica that needs them and their gradients come straight back -- point to
point, no gather through one rank. Across tensor-parallel groups (activations are
replicated inside a TP group) receiver TP rank ``j`` takes its copy from sender TP
rank ``j mod tp_A``, and on the way back sender TP rank ``i`` takes the gradient
from receiver TP rank ``i mod tp_B``: every rank gets what it needs from exactly
one peer. Empty pieces (a microbatch block without images) are not sent at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from .units import ParallelismUnit

ACT, GRAD = "act", "grad"


@dataclass(frozen=True)
class Piece:
    rank: int  # the peer
    rows: range  # rows of this side's tensor


class CommBroker:
    """Routing for one schedule.

    ``stage_places[s]`` is the (unit, pipeline index inside the unit) that runs
    schedule stage ``s``; ``row_places[r]`` the same for schedule row ``r`` (rows
    and stages differ only for virtual stages); ``image_rows[s]`` says whether the
    tensor leaving stage ``s`` has one row per image (the encoder's) or per sample.
    """

    def __init__(
        self,
        stage_places: list[tuple[ParallelismUnit, int]],
        row_places: list[tuple[ParallelismUnit, int]],
        image_rows: list[bool],
        samples_per_microbatch: int,
    ):
        self.stage_places = stage_places
        self.row_places = row_places
        self.image_rows = image_rows
        self.samples = samples_per_microbatch
        self.image_counts: list[list[int]] = []  # per microbatch, per sample of the global microbatch
        self._memo: dict[tuple, tuple[Piece, ...]] = {}  # _pieces' answers: a schedule asks each many times

    def set_image_counts(self, image_counts: list[list[int]]) -> None:
        self.image_counts = image_counts
        self._memo.clear()

    def ranks_of_row(self, row: int) -> list[int]:
        unit, pp = self.row_places[row]
        return [unit.rank_at(d, i, pp) for d in range(unit.dp) for i in range(unit.inner)]

    def _rows(self, samples: range, block: range, images: bool, k: int) -> range:
        """Rows of ``samples`` (a sub-range of ``block``) in the tensor holding ``block``."""
        if not images:
            return range(samples.start - block.start, samples.stop - block.start)
        counts = self.image_counts[k]
        start = sum(counts[block.start : samples.start])
        return range(start, start + sum(counts[samples.start : samples.stop]))

    def _pieces(
        self,
        sender: tuple[ParallelismUnit, int],
        receiver: tuple[ParallelismUnit, int],
        images: bool,
        k: int,
        rank: int,
        sending: bool,
    ) -> tuple[Piece, ...]:
        """Pieces between ``rank`` (the sender if ``sending``, else the receiver) and its peers.

        Receiver TP rank ``j`` always listens to sender TP rank ``j mod tp_sender`` (with context parallelism:
        inner positions ``cp * tp + tp_rank``, units.py; between stages of one unit CP rank c talks to CP rank c,
        the sequence slices stay where they are). Only image rows depend on the microbatch ``k``: other answers
        are remembered per boundary and rank.
        """
        key = (id(sender[0]), sender[1], id(receiver[0]), receiver[1], images, k if images else None, rank, sending)
        pieces = self._memo.get(key)
        if pieces is None:
            pieces = self._memo[key] = self._find_pieces(sender, receiver, images, k, rank, sending)
        return pieces

    def _find_pieces(self, sender, receiver, images: bool, k: int, rank: int, sending: bool) -> tuple[Piece, ...]:
        (src, src_pp), (dst, dst_pp) = sender, receiver
        me_unit = src if sending else dst
        other = dst if sending else src
        other_pp = dst_pp if sending else src_pp
        d, _, _ = me_unit.coords(rank)
        t = me_unit.inner_index(rank)
        mine = me_unit.block(d, self.samples)
        pieces = []
        for o in range(other.dp):
            theirs = other.block(o, self.samples)
            shared = range(max(mine.start, theirs.start), min(mine.stop, theirs.stop))
            rows = self._rows(shared, mine, images, k) if shared else range(0)
            if not rows:
                continue
            if sending:
                pieces += [Piece(dst.rank_at(o, j, other_pp), rows) for j in range(dst.inner) if j % src.inner == t]
            else:
                pieces.append(Piece(src.rank_at(o, t % src.inner, other_pp), rows))
        return tuple(sorted(pieces, key=lambda piece: (piece.rows.start, piece.rank)))

    def outgoing(self, kind: str, stage: int, k: int, rank: int) -> tuple[Piece, ...]:
        """Pieces ``rank`` sends after running ``stage`` (ACT: to stage+1; GRAD: to stage-1)."""
        target = stage + 1 if kind == ACT else stage - 1
        boundary = stage if kind == ACT else target  # the boundary lies after this stage
        return self._pieces(
            self.stage_places[stage], self.stage_places[target], self.image_rows[boundary], k, rank, sending=True
        )

    def incoming(self, kind: str, stage: int, k: int, rank: int) -> tuple[Piece, ...]:
        """Pieces ``rank`` (running ``stage``) receives, in row order (ACT from stage-1, GRAD from stage+1)."""
        source = stage - 1 if kind == ACT else stage + 1
        boundary = source if kind == ACT else stage
        return self._pieces(
            self.stage_places[source], self.stage_places[stage], self.image_rows[boundary], k, rank, sending=False
        )
