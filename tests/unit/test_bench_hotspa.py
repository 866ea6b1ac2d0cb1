"""tools/bench_hotspa.py: the memory limit leaves no room for pure data parallelism at the longest bucket but
some static candidate fits, and one tiny alternation (HotSPa and the fitting static strategies, 4 processes,
2 steps) writes a JSON with its tokens/s, ratio and switch share."""

import json

import pytest

from ..conftest import REPO

pytestmark = pytest.mark.distributed

TINY = ["max_len=512", "buckets=64,128,512", "strategies=dp4,dp4,cp4", "static=dp2cp2,cp4", "documents=8"]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import bench_hotspa

    return bench_hotspa


def test_the_limit_refuses_pure_data_parallelism_at_the_longest_bucket(bench):
    from disttrain_core.launch.cli import split_tool_args

    options, _ = split_tool_args(TINY, bench.OPTIONS)
    limit_gb, margin, needs = bench.memory_limit(options, [])
    floor = needs["dp4 (zero3, full recompute)"]
    assert floor > limit_gb * 1e9 * margin  # not even zero3 with full recompute fits
    assert min(needs["dp2cp2"], needs["cp4"]) <= limit_gb * 1e9 * margin


def test_every_strategy_the_runtime_accepts_is_a_static_candidate_by_default(bench):
    """static=all: pure pipeline parallelism is a candidate too (its absence once made a 0.82x look like 1.41x)."""
    from disttrain_core.launch.cli import split_tool_args

    options, _ = split_tool_args([o for o in TINY if not o.startswith("static=")], bench.OPTIONS)
    assert options["static"] == "all"
    _, _, needs = bench.memory_limit(options, [])
    assert {"pp4", "dp2tp2", "tp2pp2", "dp2cp2", "cp4", "dp4"} <= set(needs)


@pytest.mark.slow  # 16 s: the benchmark end to end
def test_one_alternation_writes_its_measurements(bench, tmp_path):
    out = tmp_path / "bench.json"
    args = [*TINY, "alternations=1", "steps=2", "skip=1", "predict=false", "format=json", f"out={out}"]
    assert bench.main(args) == 0
    result = json.loads(out.read_text())
    entry = result["alternations"][0]
    assert entry["hotspa"]["tokens_per_s"] > 0 and 0 < entry["hotspa"]["switch_fraction"] < 1
    assert entry["best_static"] in result["static_that_fit"] and result["ratio_median"] > 0
    assert result["ratio_median"] == pytest.approx(
        entry["hotspa"]["tokens_per_s"] / entry[entry["best_static"]]["tokens_per_s"]
    )


def test_the_prediction_at_the_seeds_scale_is_complete(bench, tmp_path):
    """llama2_32b on 32 A800s: the artifact's strategies and the fastest per bucket, each against every static
    strategy that holds 32K tokens; a PNG of the predicted step."""
    out, picture = tmp_path / "bench.json", tmp_path / "step.png"
    assert bench.main(["measure=false", "format=json", f"out={out}", f"picture={picture}"]) == 0
    predicted = json.loads(out.read_text())["predicted_at_scale"]
    for key in ("artifact_strategies", "fastest_per_bucket"):
        p = predicted[key]
        assert len(p["strategies"]) == 3 and p["best_static"] in p["static_step_s"]
        assert 0 < p["switch_s_per_step"] < p["hotspa_step_s"]
        assert sum(p["bucket_s"]) + p["home_sync_s"] + p["switch_s_per_step"] == pytest.approx(p["hotspa_step_s"])
        assert p["speedup_over_best_static"] > 0 and p["speedup_over_longest_bucket_strategy"] > 0
    assert predicted["artifact_strategies"]["strategies"] == ["dp4tp2pp4", "dp2tp8pp2", "tp8pp4"]
    assert picture.stat().st_size > 5000
