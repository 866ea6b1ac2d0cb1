"""Mixture-of-experts Llama blocks (models/moe.py) with expert parallelism train as on one process.

The load-balancing loss is defined over a *global microbatch* (every replica's share of microbatch k,
``balance_group``: the data x context ranks), so a one-process reference runs the same global microbatches:
micro_batch_size x dp samples each. With a capacity, each process drops assignments beyond the capacity
of the tokens *it* routes.
"""

import pytest

from ..conftest import cli_overrides, read_metrics, run_train
from .test_units import assert_same_run, train

pytestmark = pytest.mark.distributed

# the grouped expert matmuls (auto takes them on CUDA only): expert parallelism against one process with them
MOE = ["model=llama_moe_tiny", "optim.global_batch_size=16", "model.llm.moe.experts_kernel=grouped"]
DP4_EP2 = ["parallel=zero1", "parallel.ep=2", "trainer.devices=4", "optim.micro_batch_size=2"]


@pytest.fixture(scope="module")
def one8(one_process):
    """One process over global microbatches of 8 (the dp4 x micro 2 and dp2 x micro 4 layouts' references)."""
    return one_process(*MOE, "optim.micro_batch_size=8")


def test_expert_parallel_moe_matches_one_process(shards, tmp_path, one8):
    """dp4 with ep2 (experts on 2 of 4 ranks each, expert weights data-parallel over the other 2) = one
    process over the same global microbatches."""
    assert_same_run(train(shards, tmp_path / "dp4_ep2", *MOE, *DP4_EP2), one8)


def test_expert_parallel_with_fsdp2_matches_one_process_across_a_resume(shards, tmp_path, one8):
    """dp4 with ep2 and FSDP2 (zero3) for the dense parameters -- FSDP2 ignores the experts, which their own
    optimizer steps -- stopped after step 3 and resumed from its checkpoint = one process."""
    run = tmp_path / "dp4_ep2_zero3"
    fsdp = ["parallel=dp", "parallel.shard=zero3", "parallel.ep=2", "trainer.devices=4", "optim.micro_batch_size=2"]
    train(shards, run, *MOE, *fsdp, "trainer.exit_after_step=3")
    train(shards, run, *MOE, *fsdp, "trainer.resume=auto")
    assert_same_run(run, one8)


@pytest.mark.slow  # 3 runs, 60 s
def test_expert_parallel_checkpoint_resumes_without_expert_parallelism(shards, tmp_path, one8):
    """dp4 with ep2 stopped at step 3 resumes as plain dp4 (experts are saved by name) to the same step 5."""
    one = one8
    resumed = tmp_path / "resumed"
    train(shards, resumed, *MOE, *DP4_EP2, "trainer.exit_after_step=3")
    plain = ["parallel=zero1", "trainer.devices=4", "optim.micro_batch_size=2", "trainer.resume=auto"]
    train(shards, resumed, *MOE, *plain)
    assert_same_run(resumed, one)


def test_context_and_expert_parallel_moe_matches_one_process(shards, tmp_path, one_process):
    """dp2 x cp2 with ep2: each CP rank routes its own positions to the experts of its EP peer."""
    one = one_process(*MOE, "optim.micro_batch_size=4")
    layout = ["parallel=dp", "parallel.cp=2", "parallel.ep=2", "trainer.devices=4", "optim.micro_batch_size=2"]
    run = train(shards, tmp_path / "dp2_cp2_ep2", *MOE, *layout)
    assert_same_run(run, one)
    assert all(m["moe/dropped_assignments"] == 0 for m in read_metrics(run))


def test_tensor_and_expert_parallel_moe_matches_one_process(shards, tmp_path, one8):
    """dp2 x tp2 with ep2: each TP pair routes the same tokens and runs its half of every expert's hidden width
    (the partial outputs reduce-scattered into the sequence-parallel rows); the EP pairs are the data-parallel
    replicas of one TP rank."""
    layout = ["parallel.mode=megatron", "parallel.dp=2", "parallel.tp=2", "parallel.pp=1", "parallel.ep=2"]
    run = train(shards, tmp_path / "dp2_tp2_ep2", *MOE, *layout, "trainer.devices=4", "optim.micro_batch_size=4")
    assert_same_run(run, one8)


def test_capacity_drops_are_counted_and_match_per_process_capacity(shards, tmp_path):
    """With a capacity each process drops what exceeds the capacity of the tokens it routes, before the
    exchange: dp2 with ep2 drops exactly what dp2 without expert parallelism drops (each rank routing its
    own microbatches alone; tests/distributed/test_expert_parallel.py checks the same against a one-process
    layer per rank), counted in the metrics."""
    capacity = ["model.llm.moe.capacity_factor=0.5", "optim.micro_batch_size=2", "parallel=zero1", "trainer.devices=2"]
    dp2 = train(shards, tmp_path / "dp2", *MOE, *capacity)
    dp2_ep2 = train(shards, tmp_path / "dp2_ep2", *MOE, *capacity, "parallel.ep=2")
    assert_same_run(dp2_ep2, dp2)
    dropped = [m["moe/dropped_assignments"] for m in read_metrics(dp2_ep2)]
    assert dropped == [m["moe/dropped_assignments"] for m in read_metrics(dp2)]
    assert min(dropped) > 0


@pytest.mark.slow  # 28 s: a 40-step run; the balancing loss's gradient is checked in make test (test_expert_parallel)
def test_balancing_brings_expert_load_under_1_3_on_the_embedded_data(shards, tmp_path):
    """200 steps of a 2-layer llama_moe_tiny on 64-token sequences: the aux loss (coefficient 0.01) and the
    aux-loss-free bias both bring the worst layer's max/mean expert load under 1.3 (mean of the last 30
    steps); without either it stays above 1.5."""
    small = [
        "model=llama_moe_tiny",
        "model.seq_len=64",
        "model.llm.n_layers=2",
        "optim.global_batch_size=8",
        "optim.micro_batch_size=8",
        "trainer.max_steps=200",
        "trainer.checkpoint.every_n_steps=0",
    ]

    def final_load(name, *overrides):
        run = tmp_path / name
        result = run_train(cli_overrides(shards, run) + small + list(overrides), timeout=400)
        assert result.returncode == 0, result.stderr[-3000:]
        ratios = [m["moe/max_load_ratio"] for m in read_metrics(run)]  # logged every step
        assert len(ratios) == 200
        return sum(ratios[-30:]) / 30

    assert final_load("aux_loss") < 1.3
    assert final_load("aux_free", "model.llm.moe.router=aux_free") < 1.3
    assert final_load("none", "model.llm.moe.aux_loss_coef=0") > 1.5


def test_expert_parallel_inside_a_pipeline_matches_dp2(shards, tmp_path):
    """dp2 x pp2 with ep2 (the MoE blocks of each pipeline stage exchange tokens with the stage's EP peer) against
    dp2 of the same MoE without a pipeline or expert parallelism, within 1e-5. Against dp2, not one process: top-k
    routing turns the data-parallel all-reduce's summation order into 1.4e-4 against one process after 5 steps in
    every layout (dp2 alone included), while a pipeline and the expert exchange add no difference of their own."""
    micro = ["optim.micro_batch_size=4"]
    dp2 = train(shards, tmp_path / "dp2", *MOE, *micro, "parallel=zero1", "trainer.devices=2")
    layout = ["parallel.mode=megatron", "parallel.dp=2", "parallel.tp=1", "parallel.pp=2", "parallel.ep=2"]
    run = train(shards, tmp_path / "dp2_pp2_ep2", *MOE, *micro, *layout, "trainer.devices=4")
    assert_same_run(run, dp2, tol=1e-5)
