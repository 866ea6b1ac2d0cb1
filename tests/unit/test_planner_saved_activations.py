"""The recompute policies that move or split saved activations (``offload``, ``full_partitioned``:
parallel/saved_activations.py) in the planner: their costs by hand, that llama3_8b at 128K positions fits 4 H100s
only with planner.offload (its activations and optimizer on the hosts; 8 without: tools/plan.py prints both), that
the hosts must hold what moves there, and bad input, one line each. Analytic costs only."""

import pytest

from disttrain_core.config import compose, typed_config

LONG = ["model=llama3_8b", "model.seq_len=131072", "cluster=h100_80g", "planner.baselines=false"]


def _costs(**settings):
    from disttrain_core.planner import CostModel, Hardware, workload_of
    from disttrain_core.planner.costs import PlannerSettings

    cfg = compose(["model=llama3_8b", "cluster=h100_80g"])
    return CostModel(
        workload_of(cfg.model), Hardware.from_config(cfg.cluster, "bf16-mixed"), PlannerSettings(**settings)
    )


def test_offload_is_hidden_up_to_the_compute_it_overlaps_and_partitioning_costs_a_gather_per_block():
    c = _costs(sequence_parallel=False)
    moved = c.activation_bytes("llm", 2, 1, "none") / 25e9  # cluster.host_bw_gbps: 25
    for compute in (moved, 10 * moved):
        expected = max(compute / 3, moved) + max(2 * compute / 3, moved)
        assert c.saved_activation_s("llm", "offload", compute, 2, 1) == pytest.approx(expected)
    assert c.saved_activation_s("llm", "offload", 10 * moved, 2, 1) == pytest.approx(10 * moved)  # hidden
    w = c.work.units["llm"]
    gathered = w.tokens * w.dim * 4.0  # one fp32 block input per item
    gather = gathered / 2 / c.hw.intra_bw + c.hw.latency_s
    assert c.saved_activation_s("llm", "full_partitioned", 1.0, 2, 1) == pytest.approx(1.0 + w.layers * gather)
    assert c.activation_bytes("llm", 2, 1, "full_partitioned") == pytest.approx(
        c.activation_bytes("llm", 2, 1, "full") / 2
    )
    assert c.recompute_factor("llm", "full_partitioned") == c.recompute_factor("llm", "full") > 1.0
    assert c.recompute_factor("llm", "offload") == 1.0
    # auto without a unit's choice bounds what any allowed policy keeps
    auto = _costs(sequence_parallel=False, recompute="auto")
    assert auto.activation_bytes("llm", 2, 1) == c.activation_bytes("llm", 2, 1, "full_partitioned")
    assert _costs(offload=True, recompute="auto").activation_bytes("llm", 2, 1) == 0.0


def test_llama3_8b_at_128k_fits_half_the_gpus_with_activation_offload():
    from disttrain_core.planner import PlanningError, make_plan
    from disttrain_core.planner.auto import layout_container

    cfg = compose([*LONG, "cluster.num_gpus=8"])
    plan = make_plan(cfg, progress=lambda *_: None).plan.evaluation
    assert plan.feasible and plan.recompute["llm"] == "full"  # 8 H100s: full recompute is enough
    cfg = compose([*LONG, "cluster.num_gpus=4"])
    with pytest.raises(PlanningError):
        make_plan(cfg, progress=lambda *_: None, check_fit=False)
    cfg.planner.offload = True
    result = make_plan(cfg, progress=lambda *_: None, check_fit=False)
    plan = result.plan.evaluation
    assert plan.feasible and plan.choices["llm"].gpus == 4
    assert plan.recompute["llm"] == "offload" and plan.memory["llm"] <= result.model.limit
    assert layout_container(plan)["units"]["llm"]["recompute"] == "offload"
    stages, shard = len(plan.stage_times), plan.shard["llm"]
    assert result.model._host_fits("llm", plan.choices, stages, plan.microbatches, "offload", shard, plan.memory["llm"])


def test_activations_the_hosts_cannot_hold_are_not_planned():
    from disttrain_core.planner import PlanningError, make_plan

    cfg = compose([*LONG, "cluster.num_gpus=4", "cluster.host_memory_per_node_gb=64"])
    cfg.planner.offload = True
    with pytest.raises(PlanningError):
        make_plan(cfg, progress=lambda *_: None, check_fit=False)


TP2 = ["parallel.mode=megatron", "parallel.modality_stages=folded", "parallel.tp=2", "parallel.dp=1", "schedule=none"]
BAD = [
    (
        ["parallel.recompute=sometimes"],
        "allowed values are none, full, selective_op, every_k, full_partitioned, offload",
    ),
    (["parallel.recompute=full_partitioned"], "tp=1 has none; use recompute=full"),
    ([*TP2, "parallel.recompute=full_partitioned"], "sequence parallelism already splits each block's input"),
    (["parallel.recompute=offload", "trainer.compile=true"], "set trainer.compile=false or use recompute=full"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=["unknown", "tp1", "sequence_parallel", "compile"])
def test_bad_saved_activation_policies_are_one_line(overrides, message):
    from disttrain_core.planner.fit import validate_run
    from disttrain_core.validation import ConfigError

    cfg = compose(["model=llama_tiny", "trainer.devices=2", "parallel=dp", *overrides])
    with pytest.raises(ConfigError) as error:
        validate_run(typed_config(cfg))
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
