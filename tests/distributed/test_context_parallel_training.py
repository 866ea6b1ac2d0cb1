"""Context parallelism composed with data, tensor and pipeline parallelism and with the units reproduces
one process: per-step losses and final parameters within 1e-4 (fp32, 5 optimizer steps, 4 processes).

The multimodal runs cover the three ways the LLM meets the other modules under CP: a colocated encoder and
generator (embeddings placed before slicing; the generation loss from the gathered sequence, counted 1/cp
per rank) and separate encoder and generator units (image gradients summed over the CP group before they
travel back; the query gradient counted once).
"""

import pytest

from .test_units import SMALL, assert_same_run, train

pytestmark = pytest.mark.distributed

LLAMA = ["model=llama_tiny", *SMALL]
MLLM = ["model=mllm_tiny", *SMALL]


@pytest.fixture(scope="module")
def llama_reference(one_process):
    return one_process(*LLAMA)


@pytest.fixture(scope="module")
def mllm_reference(one_process):
    return one_process(*MLLM)


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel=dp", "parallel.cp=2"],  # dp2 x cp2
        # FSDP2 sharded over the 4 data x context ranks
        ["parallel=dp", "parallel.cp=2", "parallel.shard=zero3"],
        pytest.param(["parallel=dp", "parallel.cp=2", "parallel.shard=zero2"], marks=pytest.mark.slow),
        pytest.param(["parallel=megatron_pp2", "parallel.cp=2"], marks=pytest.mark.slow),  # pp2 x cp2 (25 s)
    ],
    ids=["dp2_cp2", "dp2_cp2_zero3", "dp2_cp2_zero2", "pp2_cp2"],
)
def test_llama_context_parallel_matches_one_process(layout, llama_reference, shards, tmp_path):
    run = train(shards, tmp_path / "run", *LLAMA, *layout, "trainer.devices=4")
    assert_same_run(run, llama_reference)


@pytest.mark.parametrize(
    "layout",
    [
        [
            "parallel=megatron_tp2",
            "parallel.modality_stages=folded",
            "schedule=none",
            "parallel.cp=2",
        ],  # tp2 x cp2, colocated
        [
            "parallel=megatron_tp2",
            "parallel.modality_stages=folded",
            "schedule=none",
            "parallel.cp=2",
            "parallel.shard=zero3",
        ],  # and FSDP2 over the 2 context ranks, 2-D with TP
        ["parallel=disagg4_llm2_gen1", "parallel.units.llm.dp=1", "parallel.units.llm.cp=2"],  # units
    ],
    ids=["tp2_cp2_colocated", "tp2_cp2_zero3", "units_llm_cp2"],
)
def test_multimodal_context_parallel_matches_one_process(layout, mllm_reference, shards, tmp_path):
    run = train(shards, tmp_path / "run", *MLLM, *layout, "trainer.devices=4")
    assert_same_run(run, mllm_reference)


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel=dp", "parallel.cp=2", "parallel.cp_mode=allgather"],  # dp2 x cp2, K/V all-gathered
        # dp2 x cp2 by all-to-all, FSDP2 (zero3) sharded over the 4 data x context ranks
        ["parallel=dp", "parallel.cp=2", "parallel.cp_mode=ulysses", "parallel.shard=zero3"],
        # tp2 x cp2: each rank's 2 query heads and 1 key/value head (copied for the all-to-all) of llama_tiny
        ["parallel=megatron_tp2", "schedule=none", "parallel.cp=2", "parallel.cp_mode=ulysses"],
        ["parallel=dp", "parallel.cp=4", "parallel.cp_mode=hybrid"],  # cp4 = 2 rings of 2 all-to-all ranks
    ],
    ids=["allgather_dp2_cp2", "ulysses_dp2_cp2_zero3", "ulysses_tp2_cp2", "hybrid_cp4"],
)
def test_llama_every_context_parallel_mode_matches_one_process(layout, llama_reference, shards, tmp_path):
    run = train(shards, tmp_path / "run", *LLAMA, *layout, "trainer.devices=4")
    assert_same_run(run, llama_reference)
