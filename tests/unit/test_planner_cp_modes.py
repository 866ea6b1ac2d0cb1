"""The planner and the launch with every context-parallel mode (parallel.cp_mode; comm/context_modes.py): the
communication each mode adds, by hand; the report of each mode's best plan for Llama 3 8B (8 KV heads) at 128K
positions on 32 H100s (tools/plan_cp_modes.py); that no plan picks a mode its heads do not split or a layout that
does not fit; ``auto`` resolved at launch; and bad input, one line each. Analytic costs only."""

import pytest

from disttrain_core.comm.context_modes import heads_split, ulysses_degree
from disttrain_core.config import compose, typed_config
from disttrain_core.planner import CostModel, Hardware, LayoutModel, Orchestrator, PlanningError, workload_of
from disttrain_core.planner.costs import PlannerSettings
from disttrain_core.planner.parallel_costs import allgather_kv_s, context_parallel_s, ulysses_s

from ..conftest import REPO

LLAMA_128K = ["model=llama3_8b", "model.seq_len=131072"]


def layout_model(overrides: list[str], devices: int, batch: int, **settings) -> LayoutModel:
    cfg = compose([*overrides, "cluster=h100_80g"])
    costs = CostModel(
        workload_of(cfg.model),
        Hardware.from_config(cfg.cluster, "bf16-mixed"),
        PlannerSettings(precision="bf16-mixed", **settings),
    )
    return LayoutModel(costs, batch, 1, devices)


def test_each_mode_costs_its_collectives_by_hand():
    c = layout_model(LLAMA_128K, 32, 32).c
    w = c.work.units["llm"]
    head_dim, act, lat = w.dim / w.heads, 2, c.hw.latency_s
    tokens = w.tokens / 8  # cp = 8 at tp = 1: 16,384 positions per rank
    q = tokens * w.heads * head_dim * act
    kv = tokens * w.kv_heads * head_dim * act * 2  # 8 KV heads: they split over 8 ranks, nothing copied
    expected = 2 * (2 * q + kv) * 7 / 8 / c.hw.intra_bw + 4 * 7 * lat  # one node: NVLink
    assert ulysses_s(c, "llm", 1, 8, 1, 8) == pytest.approx(expected)
    assert context_parallel_s(c, "llm", 1, 8, 1, "ulysses", 8) == pytest.approx(expected)
    dkv = kv * 2  # fp32
    gathered = 7 * ((2 * kv + dkv) / c.hw.intra_bw + 3 * lat)
    assert allgather_kv_s(c, "llm", 1, 8, 1) == pytest.approx(gathered)
    # Ulysses over 16 ranks leaves the node: the all-to-all runs at the inter-node bandwidth, its 8 KV heads copied
    kv16 = (w.tokens / 16) * 16 * head_dim * act * 2
    q16 = (w.tokens / 16) * w.heads * head_dim * act
    assert ulysses_s(c, "llm", 1, 16, 1, 16) == pytest.approx(
        2 * (2 * q16 + kv16) * 15 / 16 / c.hw.inter_bw + 4 * 15 * lat
    )
    # a hybrid is its all-to-all inside the node plus a ring across the rest, holding 1/u of the heads
    hybrid = context_parallel_s(c, "llm", 1, 16, 1, "hybrid", 8)
    assert hybrid > ulysses_s(c, "llm", 1, 16, 1, 8)
    assert c.rank_compute("llm", 1, 1, 16, 1, "hybrid", 8) == pytest.approx(
        c.compute("llm", 1, 1 / 16) + w.layers * hybrid
    )


def test_the_planner_reports_every_mode_at_128k_and_picks_the_fastest(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import plan_cp_modes

    rows = plan_cp_modes.plan_modes([])
    assert (rows["heads"], rows["kv_heads"], rows["seq_len"], rows["gpus"]) == (32, 8, 131072, 32)
    modes = [rows[m] for m in plan_cp_modes.MODES]
    assert all(row["feasible"] and row["memory_gb"] <= row["limit_gb"] for row in (rows["auto"], *modes))
    assert rows["auto"]["iteration_s"] == pytest.approx(min(row["iteration_s"] for row in modes))
    for mode in plan_cp_modes.MODES:  # each row used its mode (every one needs cp > 1 at this length)
        assert rows[mode]["llm"]["cp"] > 1 and rows[mode]["llm"]["cp_mode"] == mode
    assert "auto" in plan_cp_modes.table(rows)


@pytest.mark.parametrize(
    "overrides, devices",
    [
        (LLAMA_128K, 64),
        (["model=llama3_8b", "model.seq_len=32768"], 16),
        ([*LLAMA_128K, "model.llm.n_kv_heads=1"], 32),  # multi-query: Ulysses copies the one K/V head
        ([*LLAMA_128K, "model.llm.n_heads=24", "model.llm.dim=3072", "model.llm.n_kv_heads=3"], 32),
    ],
    ids=["128k_64", "32k_16", "mqa_128k_32", "24_heads_128k_32"],
)
def test_no_plan_picks_a_mode_that_does_not_divide_or_fit(overrides, devices):
    model = layout_model(overrides, devices, devices, recompute="full")
    solver = Orchestrator(model)
    heads, kv = int(model.w.units["llm"].heads), int(model.w.units["llm"].kv_heads)
    for option in solver.llm_options():  # every mode the search weighs splits the heads of its tp
        local, local_kv = heads // option.tp, max(1, kv // option.tp)
        assert option.cp_ulysses == ulysses_degree(option.cp_mode, option.cp, option.cp_ulysses, local, local_kv)
        assert option.cp_mode != "hybrid" or option.tp * option.cp_ulysses <= model.c.hw.per_node
    plan = solver.solve().evaluation
    llm = plan.choices["llm"]
    assert plan.feasible and plan.memory["llm"] <= model.limit
    assert heads_split(heads // llm.tp, max(1, kv // llm.tp), llm.cp_ulysses)
    if heads == 24:  # 24 heads split over 2, 4 or 8 ranks but not 16: no Ulysses over 16
        assert not any(o.cp_mode == "ulysses" and o.cp == 16 for o in solver.llm_options())


def test_auto_resolves_at_launch_to_the_least_predicted_time_that_fits():
    from disttrain_core.parallel.resolved import resolve_units
    from disttrain_core.planner.auto import auto_cp_mode

    overrides = ["model=llama_tiny", "parallel=dp", "parallel.cp=2", "trainer.devices=4", "parallel.cp_mode=auto"]
    for cluster in ("local_cpu", "h100_80g"):
        cfg = typed_config(compose([*overrides, f"cluster={cluster}"]))
        mode, ulysses, found = auto_cp_mode(cfg, resolve_units(cfg))
        assert set(found) == {"ring", "allgather", "ulysses"}  # no hybrid at cp 2
        assert found[mode][0] == min(seconds for seconds, _ in found.values())
        assert ulysses == 1
        if cluster == "local_cpu":  # no peak listed: compute counts as free, the least communication wins
            assert mode == "allgather", found


BAD = [
    (["parallel.cp_mode=sideways"], "parallel.cp_mode='sideways': allowed values are ring, allgather, ulysses, hybrid"),
    (
        ["trainer.devices=8", "parallel.cp=8", "parallel.cp_mode=ulysses"],
        "parallel.cp_mode=ulysses with cp=8: each rank's 4 query heads must divide by cp",
    ),
    (["parallel.cp_mode=hybrid"], "hybrid needs cp of 4 or more"),
    (["trainer.devices=4", "parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=3"], "cp_ulysses=3"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=["unknown", "ulysses_heads", "hybrid_cp2", "cp_ulysses"])
def test_bad_context_parallel_modes_are_one_line(overrides, message):
    from disttrain_core.planner.fit import validate_run
    from disttrain_core.validation import ConfigError

    base = ["model=llama_tiny", "parallel=dp", "parallel.cp=2", "trainer.devices=4", "parallel.shard=zero1"]
    cfg = compose([*base, *overrides])
    with pytest.raises((ConfigError, PlanningError)) as error:
        validate_run(typed_config(cfg))
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
