"""Optimizer offload in the planner (planner.offload; parallel.offload=optimizer at run time): what leaves the
device in the memory model, what the host link and the host's AdamW cost, that mllm72b fits fewer H100s with it
than without (32 without, 16 with planner.offload=true: tools/plan.py prints both), that a plan using it writes
what the runtime runs, and bad input, one line each. Analytic costs only."""

import pytest

from disttrain_core.config import compose, typed_config
from disttrain_core.planner.memory import model_state


def test_offload_moves_the_optimizer_off_the_device():
    local, trainable, dp = 1e9, 1e9, 4
    zero1 = model_state(local, trainable, dp, "zero1")
    moved = model_state(local, trainable, dp, "zero1+offload")
    assert (moved.params, moved.grads) == (zero1.params, zero1.grads) == (4e9, 4e9)
    assert moved.master == moved.moments == 0.0 and zero1.master + zero1.moments == 12e9 / dp
    assert model_state(local, trainable, dp, "zero3+offload").total == 0.0
    with pytest.raises(ValueError, match="none"):
        model_state(local, trainable, dp, "none+offload")


def test_offload_costs_the_host_step_and_the_copies_by_hand():
    from disttrain_core.planner import CostModel, Hardware, workload_of
    from disttrain_core.planner.costs import PlannerSettings, offload_s

    cfg = compose(["model=llama3_8b", "cluster=h100_80g"])
    c = CostModel(workload_of(cfg.model), Hardware.from_config(cfg.cluster, "bf16-mixed"), PlannerSettings())
    dense, _ = c._split_params("llm", 2, 4, None, 1)
    shard = dense / 8  # tp 2, pp 4, dp 8: this rank's trainable shard
    host_step, link = shard / 0.5e9, 2 * 4.0 * shard / 25e9
    assert offload_s(c, "llm", 2, 8, 4, "zero1+offload", 16) == pytest.approx(host_step + link)
    # zero3 without a pipeline copies a group's shard up for every microbatch's gather and its gradient down
    assert offload_s(c, "llm", 2, 8, 1, "zero3+offload", 16) > offload_s(c, "llm", 2, 8, 1, "zero1+offload", 16)


def test_mllm72b_fits_fewer_gpus_with_offload():
    from disttrain_core.planner import make_plan
    from disttrain_core.planner.api import smallest_gpu_cluster
    from disttrain_core.planner.auto import layout_container

    without = smallest_gpu_cluster(compose(["model=mllm72b"]))  # planner.offload=false, the default
    with_offload = smallest_gpu_cluster(compose(["model=mllm72b", "planner.offload=true"]))
    assert (without, with_offload) == (32, 16)
    cfg = compose(["model=mllm72b", "cluster=h100_80g", "cluster.num_gpus=16", "planner.baselines=false"])
    cfg.planner.offload = True
    result = make_plan(cfg, progress=lambda *_: None)
    plan = result.plan.evaluation
    assert plan.feasible and plan.shard["llm"].endswith("+offload")
    assert plan.memory["llm"] <= result.model.limit
    units = layout_container(plan)["units"]
    assert units["llm"]["offload"] == "optimizer" and units["llm"]["shard"] in ("zero1", "zero2", "zero3")
    assert units["llm"]["tp"] == 1 or units["llm"]["shard"] == "zero1"  # FSDP2's offload with TP is refused
    assert plan.choices["llm"].gpus == 16
    # the host keeps the node's offloaded state within its memory (2 TB per node, to planner.memory_margin)
    stages, policy, shard = len(plan.stage_times), plan.recompute["llm"], plan.shard["llm"]
    assert result.model._host_fits("llm", plan.choices, stages, plan.microbatches, policy, shard, plan.memory["llm"])


def test_offload_that_the_hosts_cannot_hold_is_not_planned():
    """At 16 H100s mllm72b needs about 432 GB of optimizer state on each 8-GPU node's host: with 256 GB per node
    there is no layout (and the refusal is a planning error, not a plan whose state fits nowhere)."""
    from disttrain_core.planner import PlanningError, make_plan

    overrides = ["model=mllm72b", "cluster=h100_80g", "cluster.num_gpus=16", "planner.baselines=false"]
    cfg = compose([*overrides, "cluster.host_memory_per_node_gb=256"])
    cfg.planner.offload = True
    with pytest.raises(PlanningError):
        make_plan(cfg, progress=lambda *_: None, check_fit=False)


def test_a_cpu_cluster_never_offloads():
    from disttrain_core.planner.api import build_layout_model

    cfg = compose(["model=llama_tiny", "cluster=local_cpu", "planner.cost=analytic", "cluster.peak_flops_fp32=1e11"])
    cfg.planner.offload = True
    model = build_layout_model(cfg, devices=2, progress=lambda *_: None)
    assert not model.c.settings.offload
    assert all("+offload" not in shard for shard, _ in model.memory_options())


BAD = [
    (["parallel.offload=disk"], "parallel.offload='disk': allowed values are none, optimizer"),
    (["parallel=dp", "parallel.offload=optimizer"], "DDP (shard=none) keeps whole state on every rank"),
    (
        [
            "parallel=megatron_tp2",
            "schedule=none",
            "parallel.shard=zero3",
            "parallel.offload=optimizer",
            "trainer.devices=4",
            "parallel.dp=2",
        ],
        "FSDP2's CPU offload with tensor parallelism (tp=2) is not built",
    ),
    (["parallel=zero1", "parallel.offload=optimizer", "trainer.sync_debug=error"], "drop trainer.sync_debug=error"),
    (["parallel=disagg2", "parallel.offload=optimizer"], "set parallel.units.<unit>.offload"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=["unknown", "ddp", "fsdp_tp", "sync_debug", "units"])
def test_bad_offload_is_one_line(overrides, message):
    from disttrain_core.planner.fit import validate_run
    from disttrain_core.validation import ConfigError

    cfg = compose(["model=llama_tiny", "trainer.devices=2", *overrides])
    with pytest.raises(ConfigError) as error:
        validate_run(typed_config(cfg))
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
