"""Where each process sits: data-parallel x pipeline-parallel grid and its groups.

Rank order puts the pipeline dimension outermost (rank = pp_rank * dp + dp_rank),
Megatron's default: a pipeline's stages are dp ranks apart, the replicas of one
stage are neighbours (on GPUs, inside a node, where gradient all-reduce is cheap).
Every process creates every group, in the same order (a group made only by its
members can hang later on gloo).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    world_size: int
    dp: int
    pp: int

    def __post_init__(self) -> None:
        if self.dp * self.pp != self.world_size:
            raise ValueError(f"dp({self.dp}) x pp({self.pp}) != world size ({self.world_size})")

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, pp_rank) of a global rank."""
        return rank % self.dp, rank // self.dp

    def rank_of(self, dp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.dp + dp_rank

    def pipeline_ranks(self, dp_rank: int) -> list[int]:
        return [self.rank_of(dp_rank, p) for p in range(self.pp)]

    def replica_ranks(self, pp_rank: int) -> list[int]:
        return [self.rank_of(d, pp_rank) for d in range(self.dp)]


@dataclass
class Groups:
    """This process's groups; None when the group would have one member."""

    pipeline: object | None
    replicas: object | None


def build_groups(layout: Layout, rank: int, timeout=None) -> Groups:
    if layout.world_size == 1:
        return Groups(None, None)
    mine_dp, mine_pp = layout.coords(rank)
    pipeline = replicas = None
    for dp_rank in range(layout.dp):
        members = layout.pipeline_ranks(dp_rank)
        group = dist.new_group(members, timeout=timeout) if layout.pp > 1 else None
        if dp_rank == mine_dp:
            pipeline = group
    for pp_rank in range(layout.pp):
        members = layout.replica_ranks(pp_rank)
        group = dist.new_group(members, timeout=timeout) if layout.dp > 1 else None
        if pp_rank == mine_pp:
            replicas = group
    return Groups(pipeline, replicas)
