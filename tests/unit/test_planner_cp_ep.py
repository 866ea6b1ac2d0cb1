"""The planner with the LLM's context parallelism (cp) and mixture-of-experts expert parallelism (ep):
memory per rank, MoE parameter and FLOP counts, the communication terms, and which cp / ep the solver
tries and picks. Analytic costs only (cluster presets): deterministic, no profiling."""

import pytest
import torch

from disttrain_core.config import compose, typed_config
from disttrain_core.planner import (
    COLOCATED,
    CostModel,
    Hardware,
    LayoutModel,
    Orchestrator,
    PlanningError,
    UnitChoice,
    choices_of_config,
    workload_of,
)
from disttrain_core.planner.baselines import exhaustive
from disttrain_core.planner.breakdown import role_memory
from disttrain_core.planner.costs import PlannerSettings
from disttrain_core.planner.parallel_costs import all_to_all_s, ring_attention_exposed_s


def layout_model(overrides: list[str], devices: int, batch: int, precision: str = "bf16-mixed", **settings):
    cfg = compose([*overrides, "cluster=h100_80g"])
    costs = CostModel(
        workload_of(cfg.model),
        Hardware.from_config(cfg.cluster, precision),
        PlannerSettings(precision=precision, **settings),
    )
    return LayoutModel(costs, batch, 1, devices)


MIXTRAL = ["model=mixtral_8x7b"]
LONG_LLAMA = ["model=llama3_8b", "model.seq_len=65536"]


def test_mixtral_preset_has_the_public_parameter_counts():
    w = workload_of(compose(MIXTRAL).model).units["llm"]
    assert w.params / 1e9 == pytest.approx(46.7, abs=0.05)  # 46.7B total
    assert w.active_params() / 1e9 == pytest.approx(12.9, abs=0.05)  # 12.9B per token (2 of 8 experts)
    assert (w.num_experts, w.top_k, w.expert_dim) == (8, 2, 14336)


def test_activations_and_logits_per_rank_fall_as_one_over_cp():
    model = layout_model(LONG_LLAMA, 64, 8)
    roles = {}
    for cp in (1, 2, 4, 8):
        choices = {"llm": UnitChoice(tp=1, dp=1, pp=1, cp=cp)}
        roles[cp] = role_memory(model, "llm", choices, 1, 8, "none", "zero1", 0)
    for cp in (2, 4, 8):
        assert roles[cp].activations == pytest.approx(roles[1].activations / cp)
        assert roles[cp].logits == pytest.approx(roles[1].logits / cp)
        # ZeRO-1 shards the optimizer state over the dp x cp ranks that reduce the gradients
        assert roles[cp].state.moments == pytest.approx(roles[1].state.moments / cp)
        assert roles[cp].state.params == roles[1].state.params
        assert roles[cp].total < roles[1].total


def test_expert_state_falls_with_ep_and_dense_state_does_not():
    c = layout_model(MIXTRAL, 64, 64).c
    w = c.work.units["llm"]
    tp, dp, pp = 1, 8, 4
    base = c.state("llm", tp, dp, pp, "zero1", 1, 1, 1, 1)
    for ep in (2, 4, 8):
        state = c.state("llm", tp, dp, pp, "zero1", 1, 1, 1, ep)
        expert_params = w.params_expert / pp  # per rank of a middle stage at ep=1
        held = expert_params * (1 - 1 / ep)
        assert base.params - state.params == pytest.approx(4 * held)  # fp32 weights: 1/ep of the experts
        assert base.grads - state.grads == pytest.approx(4 * held)
        # the held experts are stepped by an AdamW of their own on every replica (train/expert_optim.py): whole
        # moments, no master copy; under ep=1 ZeRO-1 shards both over the 8 replicas
        assert state.moments - base.moments == pytest.approx(8 * expert_params * (1 / ep - 1 / dp))
        assert base.master - state.master == pytest.approx(4 * expert_params / dp)
        assert c.local_params("llm", tp, pp, 1, ep) == pytest.approx(c.local_params("llm", tp, pp, 1) - held)
    dense = layout_model(["model=llama3_8b"], 64, 64).c
    assert dense.state("llm", 1, 8, 4, "zero1", 1, 1, 1, 1) == dense.state("llm", 1, 8, 4, "zero1", 1)


def test_moe_flops_count_only_the_active_experts():
    from disttrain_core.models.flops import module_flops

    moe_cfg = compose(["model=llama_moe_tiny"]).model
    moe = module_flops(moe_cfg)["llm"].train
    llm, experts = moe_cfg.llm, moe_cfg.llm.moe
    # dense with the same parameters (one MLP as wide as all experts) vs. dense as wide as the active ones
    total_cfg = compose(["model=llama_tiny", f"model.llm.ffn_dim={experts.num_experts * experts.expert_ffn_dim}"])
    active_cfg = compose(["model=llama_tiny", f"model.llm.ffn_dim={experts.top_k * experts.expert_ffn_dim}"])
    dense_total = module_flops(total_cfg.model)["llm"].train
    dense_active = module_flops(active_cfg.model)["llm"].train
    assert moe < dense_total
    router = 3 * 2 * llm.dim * experts.num_experts * moe_cfg.seq_len * llm.n_layers
    assert moe == pytest.approx(dense_active + router)
    w = workload_of(moe_cfg).units["llm"]
    assert w.train_flops == moe and w.flops_moe < w.train_flops  # the workload's own count agrees
    assert w.active_params() < w.params


def test_tensor_parallelism_splits_the_experts_not_the_routers():
    """As the runtime does (parallel/tensor_parallel.py): each expert's hidden width and the shared experts split
    over TP; the routers are whole on every TP rank, and so are their FLOPs."""
    c = layout_model(["model=llama_moe_tiny", "model.llm.moe.shared_experts=1"], 8, 8).c
    cfg = compose(["model=llama_moe_tiny"]).model.llm
    w = c.work.units["llm"]
    assert w.params_moe_rep == cfg.n_layers * cfg.dim * cfg.moe.num_experts  # the routers only
    assert w.flops_moe == 3 * 2 * cfg.dim * cfg.moe.num_experts * w.tokens * cfg.n_layers
    split = w.params_dense_tp + w.params_expert  # attention, shared and routed experts
    one, two = c.local_params("llm", 1, 1), c.local_params("llm", 2, 1)
    assert one - two == pytest.approx(split / 2 + (w.vocab_first + w.vocab_last) / 2)
    assert c._split_params("llm", 2, 1, None, 2)[1] == pytest.approx(w.params_expert / 4)
    assert w.tp_allowed(2) and not w.tp_allowed(3)
    odd = layout_model(["model=llama_moe_tiny", "model.llm.moe.expert_ffn_dim=175"], 8, 8).c.work.units["llm"]
    assert not odd.tp_allowed(2)  # the experts' width does not split in 2


def test_moe_activation_formula_matches_what_autograd_saves():
    from disttrain_core.models.llama import Llama
    from disttrain_core.planner.activation_count import counted_saved_bytes

    wider = ["model.llm.dim=512", "model.llm.n_heads=8", "model.llm.moe.expert_ffn_dim=1024"]
    overrides = ["model=llama_moe_tiny", *wider]
    cfg = compose(overrides)
    model = layout_model(overrides, 1, 8, precision="32")
    predicted = model.c.activation_bytes("llm", 1, 2, "none") / cfg.model.llm.n_layers
    llm = Llama(cfg.model.llm, cfg.model.seq_len)
    x = torch.randn(2, cfg.model.seq_len, cfg.model.llm.dim, requires_grad=True)
    measured = counted_saved_bytes(lambda h: llm.layers["0"](h, llm.rope), (x,))
    assert 0.9 < predicted / measured < 1.1, (predicted, measured)


def test_cp_splits_compute_and_adds_only_the_unhidden_ring_time():
    c = layout_model(LONG_LLAMA, 64, 8).c
    whole = c.compute("llm", 1, 1)
    for cp in (2, 4, 8):
        ring = ring_attention_exposed_s(c, "llm", 1, cp, 1)
        assert ring >= 0
        assert c.rank_compute("llm", 1, 1, cp) == pytest.approx(whole / cp + c.work.units["llm"].layers * ring)
    # over a slow link the K/V blocks no longer hide behind attention
    slow = CostModel(c.work, Hardware(**{**c.hw.__dict__, "intra_bw": 1e6}), c.settings)
    assert ring_attention_exposed_s(slow, "llm", 1, 2, 1) > 100 * ring_attention_exposed_s(c, "llm", 1, 2, 1)


def test_all_to_all_time_by_hand():
    c = layout_model(MIXTRAL, 64, 64).c
    w = c.work.units["llm"]
    assert all_to_all_s(c, "llm", 1, 1, 1, 1) == 0.0
    ep = 4
    nbytes = w.tokens * w.top_k * w.dim * 2 * (ep - 1) / ep  # bf16 rows of one all-to-all
    latency = (ep - 1) * c.hw.latency_s
    expected = 4 * (nbytes / c.hw.intra_bw + latency) + latency
    assert all_to_all_s(c, "llm", 1, 1, ep, 1) == pytest.approx(expected)
    moe_blocks = w.layers * expected
    assert c.rank_compute("llm", 1, 1, 1, ep) == pytest.approx(c.compute("llm", 1, 1) + moe_blocks)


def test_cp_is_tried_only_for_long_sequences():
    assert Orchestrator(layout_model(["model=mllm9b"], 64, 64)).cp_options == (1,)  # 4k tokens
    assert Orchestrator(layout_model(["model=llama3_8b"], 64, 64)).cp_options == (1, 2)  # 8k: 4k per rank
    assert Orchestrator(layout_model(MIXTRAL, 64, 64)).cp_options == (1, 2, 4, 8)  # 32k
    assert Orchestrator(layout_model(["model=llama_tiny"], 4, 8), min_cp_tokens=64).cp_options == (1, 2, 4)


def test_solver_picks_cp_when_a_long_sequence_fits_no_other_way():
    # 128k tokens: without CP, 21 GB of vocabulary-parallel logits per rank at tp=8 on top of the activations
    # (with plain TP: sequence parallelism would split the residual stream that full recompute keeps by 8)
    model = layout_model(["model=llama3_8b", "model.seq_len=131072"], 32, 32, recompute="full", sequence_parallel=False)
    with pytest.raises(PlanningError, match="memory"):
        Orchestrator(model, cp_options=(1,)).solve()
    plan = Orchestrator(model).solve().evaluation
    llm = plan.choices["llm"]
    assert plan.feasible and llm.cp > 1 and llm.gpus == llm.tp * llm.cp * llm.dp * llm.pp <= 32
    assert plan.memory["llm"] <= model.limit
    order = ["zero1", "zero2", "zero3"]  # the least sharding that fits this layout
    for lighter in order[: order.index(plan.shard["llm"])]:
        used = model.unit_memory("llm", plan.choices, llm.pp, plan.microbatches, plan.recompute["llm"], lighter)
        assert used > model.limit, lighter
    assert model.evaluate(llm, None, None).iteration_s == pytest.approx(plan.iteration_s)
    assert plan.iteration_s <= exhaustive(Orchestrator(model)).evaluation.iteration_s * 1.001


def test_ep_is_tried_only_where_it_divides_the_experts_and_dp():
    solver = Orchestrator(layout_model(["model=llama_moe_tiny"], 16, 48))
    options = list(solver.llm_options())
    assert {o.ep for o in options} == {1, 2, 4}
    assert all(4 % o.ep == 0 and o.dp % o.ep == 0 for o in options)
    assert any(o.dp % 4 == 0 and o.ep == 4 for o in options)
    assert {o.ep for o in Orchestrator(solver.m, allow_ep=False).llm_options()} == {1}
    assert {o.ep for o in Orchestrator(layout_model(["model=llama_tiny"], 16, 48)).llm_options()} == {1}
    model = layout_model(MIXTRAL + ["model.seq_len=4096"], 64, 480, recompute="auto")
    plan = Orchestrator(model).solve().evaluation
    llm = plan.choices["llm"]
    assert 8 % llm.ep == 0 and llm.dp % llm.ep == 0 and plan.memory["llm"] <= model.limit


def test_auto_layout_writes_cp_and_ep_only_where_the_runtime_has_it():
    from disttrain_core.planner.auto import layout_container
    from disttrain_core.planner.evaluate import Evaluation
    from disttrain_core.validation import ConfigError

    def evaluation(llm):
        return Evaluation(1.0, True, llm.gpus, 1, [], {}, 0.0, "", {"llm": llm}, {"llm": "none"}, {"llm": "zero1"})

    units = layout_container(evaluation(UnitChoice(tp=2, dp=2, pp=1, cp=4)))["units"]
    assert units["llm"]["cp"] == 4 and "ep" not in units["llm"] and "cp" not in units["encoder"]
    assert layout_container(evaluation(UnitChoice(dp=4, ep=2)), with_ep=True)["units"]["llm"]["ep"] == 2
    with pytest.raises(ConfigError, match="ep=2"):
        layout_container(evaluation(UnitChoice(dp=4, ep=2)))


def test_a_configured_cp_layout_is_seen_by_the_planner():
    cfg = compose(["model=llama_tiny", "parallel=megatron_tp2", "parallel.dp=2", "parallel.cp=2", "trainer.devices=8"])
    llm, enc, gen, _ = choices_of_config(cfg)
    assert (llm.tp, llm.cp, llm.dp, llm.gpus) == (2, 2, 2, 8) and enc is None and gen is None
    assert COLOCATED.gpus == 0


def test_flex_document_attention_is_refused_under_context_parallelism():
    """Only reachable on CUDA (flex is refused elsewhere first): the ring runs its blocks with its own kernel."""
    from disttrain_core.parallel.resolved import resolve_units
    from disttrain_core.validation import ConfigError
    from disttrain_core.validation.layout import check_layout

    overrides = ["model=llama_tiny", "parallel=dp", "parallel.cp=2", "trainer.devices=4", "parallel.shard=zero1"]
    cfg = typed_config(compose(overrides))
    check_layout(cfg, resolve_units(cfg))
    cfg = typed_config(compose([*overrides, "model.document_attention=flex"]))
    with pytest.raises(ConfigError, match="model.document_attention=flex; ring attention computes each block"):
        check_layout(cfg, resolve_units(cfg))
