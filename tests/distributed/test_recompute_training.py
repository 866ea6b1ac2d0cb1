"""Activation recompute trains exactly like keeping the activations: one process (every policy, within
1e-6 of no recompute), a disaggregated layout with a different policy per unit, and a zero-bubble
pipeline whose split backward runs through recomputed blocks (within the parity tolerances)."""

import pytest

from ..conftest import cli_overrides, read_metrics, run_train

pytestmark = pytest.mark.distributed

COMMON = ["trainer.max_steps=5", "trainer.precision=32", "trainer.checkpoint.every_n_steps=0"]
BATCH = ["optim.global_batch_size=8", "optim.micro_batch_size=2"]


def losses(shards, run_dir, *overrides):
    result = run_train(cli_overrides(shards, run_dir) + COMMON + list(overrides), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    return [m["loss"] for m in read_metrics(run_dir)]


# make test-slow: the parallel recompute tests below cover the policies in default runs
@pytest.mark.slow
def test_every_policy_on_one_process_equals_no_recompute(shards, tmp_path):
    reference = losses(shards, tmp_path / "none", *BATCH)
    for policy in ("full", "selective_op", "every_k"):
        got = losses(shards, tmp_path / policy, *BATCH, f"parallel.recompute={policy}")
        assert got == pytest.approx(reference, abs=1e-6), policy


@pytest.mark.slow  # three runs (about 45 s); `make test-slow`. Every policy's parity runs in the default suite above
def test_a_policy_per_unit_and_a_split_backward_through_recomputed_blocks(shards, tmp_path):
    reference = losses(shards, tmp_path / "one", *BATCH)
    units = losses(
        shards,
        tmp_path / "disagg2",
        *BATCH,
        "parallel=disagg2",
        "parallel.units.encoder.recompute=selective_op",
        "parallel.units.llm.recompute=full",
    )
    assert units == pytest.approx(reference, abs=1e-4)
    text = ["model=llama_tiny", *BATCH]
    plain = losses(shards, tmp_path / "llama", *text)
    piped = losses(
        shards,
        tmp_path / "zb_h1",
        *text,
        "parallel=pp2",
        "schedule=zb_h1",
        "trainer.devices=2",
        "parallel.recompute=every_k",
        "parallel.recompute_every=1",
    )
    assert piped == pytest.approx(plain, abs=1e-5)
