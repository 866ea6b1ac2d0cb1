"""Optimizer offload (parallel.offload=optimizer; parallel/offload.py, FSDP2's CPUOffloadPolicy): 5 training steps
of llama_tiny on 2 data-parallel processes equal the same run without offload bit for bit (fp32: per-step losses
and every final parameter exactly), for ZeRO-1 (master shards and AdamW moments on the host) and zero3 (FSDP2);
and a ZeRO-1 run with offload stopped at step 3 and resumed from its checkpoint ends where the uninterrupted one
does, bit for bit. On this CPU the host is the device: these prove the bookkeeping (host masters, gradients
copied to them, the host step, checkpoints of host state), not a transfer's speed."""

import shutil

import pytest

from disttrain_core.train.checkpoint import latest_checkpoint, read_tensors

from ..conftest import cli_overrides, read_metrics, run_train

pytestmark = pytest.mark.distributed

COMMON = ["model=llama_tiny", "optim.global_batch_size=8", "optim.micro_batch_size=2", "trainer.precision=32"]
COMMON += ["trainer.devices=2", "trainer.max_steps=5"]


def _train(shards, run_dir, *overrides):
    result = run_train(cli_overrides(shards, run_dir) + COMMON + list(overrides), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def _worst(run, reference, prefix: str) -> float:
    """The largest difference between two runs' last checkpoints, over the tensors under ``prefix``."""
    ours = read_tensors(latest_checkpoint(run / "checkpoints"), prefix)
    theirs = read_tensors(latest_checkpoint(reference / "checkpoints"), prefix)
    assert theirs and set(ours) == set(theirs)
    return max((ours[k] - theirs[k]).abs().max().item() for k in theirs if theirs[k].is_floating_point())


def _assert_identical(run, reference):
    """Losses, parameters and AdamW's moments exactly equal."""
    assert [m["loss"] for m in read_metrics(run)] == [m["loss"] for m in read_metrics(reference)]
    assert _worst(run, reference, "model.") == 0.0
    assert _worst(run, reference, "optim.") == 0.0


@pytest.mark.parametrize("shard", ["zero1", "zero3"])
def test_optimizer_offload_equals_the_run_without_it_bit_for_bit(shards, tmp_path, shard):
    layout = ["parallel=dp", f"parallel.shard={shard}", "trainer.checkpoint.every_n_steps=5"]
    reference = _train(shards, tmp_path / "reference", *layout)
    offloaded = _train(shards, tmp_path / "offload", *layout, "parallel.offload=optimizer")
    _assert_identical(offloaded, reference)


def test_an_offloaded_run_resumes_exactly(shards, tmp_path):
    layout = ["parallel=dp", "parallel.shard=zero1", "parallel.offload=optimizer", "trainer.checkpoint.every_n_steps=3"]
    whole = _train(shards, tmp_path / "whole", *layout)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step_00000003", resumed / "checkpoints" / "step_00000003")
    _train(shards, resumed, *layout, "trainer.resume=auto")
    assert [m["loss"] for m in read_metrics(resumed)] == [m["loss"] for m in read_metrics(whole)][3:]
    assert _worst(resumed, whole, "model.") == 0.0 and _worst(resumed, whole, "optim.") == 0.0
