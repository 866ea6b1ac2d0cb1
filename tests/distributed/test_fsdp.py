"""FSDP2 sharding (parallel/fsdp.py) trains exactly like one process: per-step losses and final parameters
within 1e-4 (fp32, 5 optimizer steps) for zero2, zero3 and HSDP on pure data parallelism, zero3 with TP 2
(a 2-D mesh), zero3 with two pipeline stages under 1f1b, and a disaggregated layout whose LLM unit uses
zero3 while the encoder uses zero1."""

import pytest

from ..conftest import read_metrics
from .test_units import SMALL, assert_same_run, train

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def reference(one_process):
    return one_process(*SMALL)


@pytest.fixture(scope="module")
def text_reference(one_process):
    return one_process("model=llama_tiny", *SMALL)


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel=dp", "trainer.devices=2", "parallel.shard=zero2"],
        # zero3 itself trains in every test below; on pure DP it joins the slow matrix
        pytest.param(["parallel=dp", "trainer.devices=2", "parallel.shard=zero3"], marks=pytest.mark.slow),
        # HSDP: 2 replicas x 2 shards on 4 processes (a README claim); its mesh and memory are also checked on meta
        # (tests/unit/test_rehearsal.py)
        ["parallel=dp", "trainer.devices=4", "parallel.shard=zero3", "parallel.hsdp_replicas=2"],
    ],
    ids=["zero2", "zero3", "hsdp2x2"],
)
def test_pure_data_parallel_sharding_matches_one_process(overrides, reference, shards, tmp_path):
    assert_same_run(train(shards, tmp_path / "run", *overrides, *SMALL), reference)


def test_zero3_composes_with_tp_and_pipeline_stages(text_reference, shards, tmp_path):
    """2 replicas x TP 2 on one 2-D mesh; 2 replicas x 2 pipeline stages under 1f1b."""
    megatron = ["model=llama_tiny", "parallel=megatron_tp2", "parallel.shard=zero3", "trainer.devices=4"]
    assert_same_run(
        train(shards, tmp_path / "tp2", *megatron, "parallel.dp=2", "schedule=none", *SMALL), text_reference
    )
    piped = ["model=llama_tiny", "parallel=megatron_pp2", "parallel.shard=zero3", "trainer.devices=4"]
    assert_same_run(train(shards, tmp_path / "pp2", *piped, "parallel.dp=2", "schedule=1f1b", *SMALL), text_reference)


def test_llm_unit_zero3_beside_an_encoder_unit_on_zero1(reference, shards, tmp_path):
    overrides = ["parallel=disagg4_llm2_gen1", "parallel.units.llm.shard=zero3", "parallel.units.encoder.shard=zero1"]
    assert_same_run(train(shards, tmp_path / "units", *overrides, *SMALL), reference)


@pytest.mark.slow  # two 4-process runs (about 35 s); `make test-slow`
def test_zero3_with_tp_resumes_from_a_checkpoint(text_reference, shards, tmp_path):
    """Full tensors gathered from FSDP2 x TP shards (a 2-D mesh, strided shards) load back into them:
    the resumed steps equal the uninterrupted one-process run."""
    run = tmp_path / "resumed"
    layout = ["model=llama_tiny", "parallel=megatron_tp2", "parallel.dp=2", "schedule=none", "trainer.devices=4"]
    layout += ["parallel.shard=zero3", *SMALL]
    train(shards, run, *layout, "trainer.exit_after_step=3")
    train(shards, run, *layout, "trainer.resume=auto")
    resumed = {m["step"]: m["loss"] for m in read_metrics(run)}
    straight = {m["step"]: m["loss"] for m in read_metrics(text_reference)}
    assert [resumed[s] for s in (4, 5)] == pytest.approx([straight[4], straight[5]], abs=1e-4)


@pytest.mark.slow  # another 4-process pipeline run (about 40 s); `make test-slow`
def test_zero2_with_pipeline_stages_under_gpipe(text_reference, shards, tmp_path):
    piped = ["model=llama_tiny", "parallel=megatron_pp2", "parallel.shard=zero2", "trainer.devices=4"]
    assert_same_run(
        train(shards, tmp_path / "gpipe", *piped, "parallel.dp=2", "schedule=gpipe", *SMALL), text_reference
    )
