"""Bucket layout for overlapped ZeRO-1: every bucket splits evenly over the replicas, buckets follow
gradient readiness (reverse definition order), and sharding then unsharding is the identity."""

import math

import torch

from disttrain_core.comm.buckets import FlatBuckets, plan_buckets


def test_buckets_close_at_the_size_and_follow_reverse_definition_order():
    buckets = plan_buckets([10, 3, 7, 20, 1], bucket_numel=8, dp=4)
    assert [b.members for b in buckets] == [(4, 3), (2, 1), (0,)]
    for bucket in buckets:
        assert bucket.padded % 4 == 0 and bucket.padded >= bucket.numel
        assert bucket.shard_size == bucket.padded // 4
    assert [b.offset for b in buckets] == [0, 24, 36]
    assert [b.shard_offset for b in buckets] == [0, 6, 9]
    assert len(plan_buckets([10, 3, 7], math.inf, 2)) == 1
    assert plan_buckets([], math.inf, 3)[0].padded == 3  # no parameters: one empty, padded bucket


def test_graded_buckets_hold_the_first_used_parameters_in_growing_sizes():
    # bucket 40: the first-defined parameters fill buckets of at least 5, 10 and 20 elements (in
    # definition order), the rest close at 40 from the end; readiness order puts the graded ones last.
    buckets = plan_buckets([10, 3, 7, 20, 1, 5, 5, 5, 5], bucket_numel=40, dp=4, graded=True)
    assert [b.members for b in buckets] == [(8, 7, 6, 5, 4), (3,), (2, 1), (0,)]
    assert [b.numel for b in buckets] == [21, 20, 10, 10]
    assert [b.offset for b in buckets] == [0, 24, 44, 56]
    assert [b.members for b in plan_buckets([3, 4], 40, 2, graded=True)] == [(1, 0)]  # a small model
    assert len(plan_buckets([10, 3, 7], math.inf, 2, graded=True)) == 1  # one bucket stays one bucket


def test_shards_of_all_replicas_unshard_to_the_full_buffer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    params = list(model.named_parameters())
    dp = 3
    flats = [FlatBuckets(params, dp, rank, tp=1, bucket_numel=20, graded=True) for rank in range(dp)]
    assert len(flats[0].buckets) > 1
    full = flats[0].gather_params()
    gathered = torch.cat([flat.master_shard() for flat in flats])
    assert torch.equal(flats[0].unshard(gathered), full)
    for index, (_, param) in enumerate(params):
        assert torch.equal(flats[0].parameter_slice(full, index), param.detach())
    # Shards partition the parameters: every element is owned by exactly one replica.
    assert sum(m.numel() for flat in flats for m in flat.masters) == flats[0].padded


def test_interleaved_modes_take_turns_in_blocks_of_steps():
    from disttrain_core.comm.engine import interleaved_mode

    modes = ["overlap", "no_overlap", "compute_only"]
    assert [interleaved_mode(modes, 2, step)[0] for step in range(1, 9)] == list("oonnccoo")
