"""Overlapped communication changes when bytes move, never what they add up to.

Each layout is trained twice for 5 fp32 steps, with every overlap switch on and
with every one off (collectives after backward / right after the step); losses
and final parameters must agree within 1e-6. Several gradient buckets are forced
(``bucket_mb``), so buckets really complete at different times during backward.
"""

import pytest

from ..conftest import read_metrics
from .test_units import parameters, train

pytestmark = pytest.mark.distributed

OVERLAP = [
    "parallel.comm.overlap_grad_reduce=true",
    "parallel.comm.overlap_param_gather=true",
    "parallel.comm.bucket_mb=0.05",
]
NO_OVERLAP = ["parallel.comm.overlap_grad_reduce=false", "parallel.comm.overlap_param_gather=false"]
ACCUMULATE = ["optim.global_batch_size=8", "optim.micro_batch_size=2"]  # 2 microbatches per replica
SINGLE = ["optim.global_batch_size=4", "optim.micro_batch_size=2"]  # 1 microbatch per replica
TP2 = ["parallel.mode=megatron", "parallel.modality_stages=folded", "parallel.tp=2", "parallel.dp=2"]


def assert_equal_runs(a, b, tolerance):
    losses = [m["loss"] for m in read_metrics(a)]
    reference = [m["loss"] for m in read_metrics(b)]
    assert len(losses) == 5
    assert losses == pytest.approx(reference, abs=tolerance, rel=0)
    ours, theirs = parameters(a), parameters(b)
    assert set(ours) == set(theirs)
    worst = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
    assert worst <= tolerance, worst


def pair(shards, tmp_path, name, layout, batch):
    on = train(shards, tmp_path / f"{name}_on", *layout, *batch, *OVERLAP)
    off = train(shards, tmp_path / f"{name}_off", *layout, *batch, *NO_OVERLAP)
    return on, off


def test_overlap_matches_no_overlap_and_modes_switch_between_steps(shards, tmp_path):
    """ZeRO-1 with accumulation; a third run switches overlap on and off every two steps
    (``parallel.comm.interleave_modes``, what bench_overlap times) and must agree as well."""
    layout = ["parallel=zero1", "trainer.devices=2"]
    on, off = pair(shards, tmp_path, "zero1_accumulate", layout, ACCUMULATE)
    assert_equal_runs(on, off, tolerance=1e-6)
    switching = train(
        shards,
        tmp_path / "switching",
        *layout,
        *ACCUMULATE,
        *OVERLAP,
        "parallel.comm.interleave_modes=[overlap,no_overlap]",
        "parallel.comm.interleave_block=2",
    )
    assert_equal_runs(switching, off, tolerance=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,layout,batch",
    [
        ("ddp_accumulate", ["parallel=dp", "trainer.devices=2"], ACCUMULATE),
        ("ddp_single", ["parallel=dp", "trainer.devices=2"], SINGLE),
        ("zero1_single", ["parallel=zero1", "trainer.devices=2"], SINGLE),
        ("tp2_dp2_accumulate", [*TP2, "trainer.devices=4"], ACCUMULATE),
        ("tp2_dp2_single", [*TP2, "trainer.devices=4"], SINGLE),
        ("pp2_zb", ["parallel=pp2", "schedule=zb_h1", "trainer.devices=2"], ACCUMULATE),
    ],
)
def test_overlap_matches_no_overlap_more_layouts(name, layout, batch, shards, tmp_path):
    assert_equal_runs(*pair(shards, tmp_path, name, layout, batch), tolerance=1e-6)


def test_chunked_sequence_parallel_tp_matches_plain_tp(shards, tmp_path):
    """AsyncTP-style chunked all-gather/reduce-scatter matmuls against Megatron TP's all-reduces."""
    layout = ["parallel.mode=megatron", "parallel.modality_stages=folded", "parallel.tp=2", "trainer.devices=2"]
    chunked = train(shards, tmp_path / "sp", *layout, *ACCUMULATE, *OVERLAP, "parallel.comm.tp_overlap=true")
    plain = train(shards, tmp_path / "tp", *layout, *ACCUMULATE, *NO_OVERLAP)
    # Partial sums are added in a different order (ring vs all-reduce): equal up to float rounding.
    assert_equal_runs(chunked, plain, tolerance=1e-5)
