"""parallel=auto on this CPU: profile (then reuse the cache), solve, train with the chosen layout;
and the memory model against the peak memory a real run measures."""

import json

import pytest

from disttrain_core.config import compose
from disttrain_core.planner import COLOCATED, CostModel, Hardware, LayoutModel, UnitChoice, workload_of
from disttrain_core.planner.costs import PlannerSettings

from ..conftest import cli_overrides, read_metrics, run_train

pytestmark = pytest.mark.distributed


def test_auto_profiles_solves_and_trains_then_reuses_the_profile(shards, tmp_path):
    cache = tmp_path / "profiles"
    common = [
        "parallel=auto",
        "trainer.devices=2",
        "trainer.max_steps=3",
        "trainer.checkpoint.every_n_steps=0",
        "optim.global_batch_size=8",
        "optim.micro_batch_size=2",
        f"planner.profile_cache={cache}",
        "planner.profile_repeats=1",
    ]
    first = run_train(cli_overrides(shards, tmp_path / "first") + common, timeout=500)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "profiling mllm_tiny" in first.stdout and "predicted iteration" in first.stdout
    plan = json.loads((tmp_path / "first" / "plan.json").read_text())
    assert plan["cost_model"] == "profiled" and plan["gpus_used"] <= 2
    config = (tmp_path / "first" / "config.yaml").read_text()
    assert "mode: manual" in config  # the plan was handed to the units runtime
    metrics = read_metrics(tmp_path / "first")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["loss"] > 0 for m in metrics)
    assert list(cache.glob("*.json"))

    second = run_train(cli_overrides(shards, tmp_path / "second") + common + ["trainer.dry_run=true"], timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "profiling" not in second.stdout  # the cached profile was used
    assert json.loads((tmp_path / "second" / "plan.json").read_text())["units"] == plan["units"]


# make test-slow: the memory model is checked against counted bytes in test_memory.py and the rehearsal
@pytest.mark.slow
def test_memory_model_matches_the_measured_peak_of_a_real_run(shards, tmp_path):
    """One process, mllm_small with 8 samples per microbatch in fp32: activations dominate."""
    overrides = ["model=mllm_small", "optim.global_batch_size=8", "optim.micro_batch_size=8"]
    result = run_train(
        cli_overrides(shards, tmp_path / "run")
        + overrides
        + ["trainer.max_steps=2", "trainer.checkpoint.every_n_steps=0", "trainer.checkpoint.save_last=false"],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    measured_gb = max(m["perf/peak_memory_gib"] for m in read_metrics(tmp_path / "run")) * 2**30 / 1e9
    cfg = compose(overrides + ["cluster=local_cpu"])
    costs = CostModel(
        workload_of(cfg.model),
        Hardware.from_config(cfg.cluster, "32", peak_flops=1e11),
        PlannerSettings(precision="32"),
    )
    model = LayoutModel(costs, 8, 8, 1)
    predicted_gb = model.evaluate(UnitChoice(1, 1, 1), COLOCATED, COLOCATED).memory["llm"] / 1e9
    assert 0.7 < predicted_gb / measured_gb < 1.3, (predicted_gb, measured_gb)
