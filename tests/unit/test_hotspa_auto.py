"""parallel.hotspa.strategies=[auto]: buckets and strategies chosen before launch from the planner's cost
and memory models: the set with the shortest predicted step, every bucket on a strategy that holds it (the
long bucket sharded when the memory limit leaves pure data parallelism out), validated like a written one.
Whether the prediction ranks strategies as they measure is a benchmark question (docs/HOTSPA.md)."""

import json

import pytest
from omegaconf import OmegaConf

from disttrain_core.config import compose, typed_config
from disttrain_core.parallel.switch_plan import Strategy
from disttrain_core.planner.fit import validate_run
from disttrain_core.planner.hotspa_auto import bucket_sets, candidate_strategies, choose, resolve_hotspa_auto
from disttrain_core.validation import ConfigError

# tools/bench_hotspa.py's workload at its memory limit: dp4 with zero3 and full recompute cannot hold 1,024 tokens
TIGHT = [
    "parallel=hotspa",
    "parallel.hotspa.strategies=[auto]",
    "model.seq_len=1024",
    "data.packing.buckets=null",
    "data.packing.documents_per_step=128",
    "data.packing.length_scale=0.03125",
    "parallel.recompute=full",
    "cluster.runtime_overhead_gb=0",
    "cluster.memory_per_device_gb=0.02357",
    "trainer.accelerator=cpu",
]


def _cfg(*overrides):
    return typed_config(compose(list(overrides)))


def test_bucket_sets_and_candidates_cover_the_run():
    sets = bucket_sets(1024, 3)
    assert [1024] in sets and [128, 512, 1024] in sets and [16, 1024] in sets
    assert all(s[-1] == 1024 and s == sorted(set(s)) and len(s) <= 3 for s in sets)
    assert len(sets) == 1 + 6 + 15  # powers of two 16..512: 6 of them
    names = {s.name for s in candidate_strategies(4)}
    assert {"dp4", "dp2tp2", "tp2pp2", "dp2cp2", "pp4", "tp4", "cp4"} <= names
    assert all(s.world == 4 for s in candidate_strategies(4))


def test_auto_picks_the_fastest_predicted_set_and_the_result_validates(tmp_path):
    cfg = _cfg(*TIGHT)
    validate_run(cfg)  # auto passes validation; the choice is validated after it is made
    result = choose(cfg)
    assert result == choose(cfg)  # every process that plans gets the same answer
    buckets, strategies = result["buckets"], [Strategy.parse(s) for s in result["strategies"]]
    assert buckets[-1] == 1024 and len(buckets) == len(strategies) >= 1
    assert strategies[-1].dp < 4, f"{strategies[-1].name}: pure data parallelism cannot hold 1,024 tokens here"
    options = result["options"]
    assert len(options) > 10 and all(o["buckets"][-1] == 1024 for o in options)
    assert result["chosen"]["hotspa_step_s"] == min(o["hotspa_step_s"] for o in options)
    for option in options:  # each bucket runs on a strategy that holds it
        assert all(option["fits"][s][b] for s, b in zip(option["strategies"], option["buckets"], strict=True))
    container = resolve_hotspa_auto(cfg, OmegaConf.to_container(compose(TIGHT)), tmp_path)
    resolved = typed_config(container)
    assert list(resolved.data.packing.buckets) == buckets
    validate_run(resolved)  # every chosen strategy fits its bucket by the same memory model
    assert (tmp_path / "hotspa_plan.json").is_file()


def test_auto_refusals_are_one_line():
    with pytest.raises(ConfigError, match="no strategy over 4 processes holds rows of 1024 tokens") as error:
        choose(_cfg(*TIGHT, "cluster.memory_per_device_gb=0.001"))
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="strategies=\\[auto\\] chooses them: unset home"):
        validate_run(_cfg(*TIGHT, "parallel.hotspa.home=dp4"))
    from disttrain_core.parallel.hotspa_layout import parse_strategies

    with pytest.raises(ValueError, match="chosen by train.py before launch"):
        parse_strategies(_cfg(*TIGHT))


def _profile(tmp_path, cfg, strategies: dict[str, tuple[float, float, float]], **identity):
    from disttrain_core.planner.hotspa_auto import PROFILE_FORMAT, profile_identity

    entries = {name: {"a": a, "b": b, "c": c, "sync_s": 0.01} for name, (a, b, c) in strategies.items()}
    raw = {"format": PROFILE_FORMAT, "identity": {**profile_identity(cfg, 4), **identity}, "strategies": entries}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(raw))
    return path


def test_a_measured_profile_replaces_the_analytic_costs(tmp_path):
    """Measured row times decide: pure DP cheapest per token where it fits, tp2pp2 next, dp2cp2 dear (as ring
    attention measures here): auto keeps dp2cp2 out and runs the short buckets on dp4."""
    cfg = _cfg(*TIGHT)
    per_token = {"dp4": (1e-8, 4e-5, 0.0), "tp2pp2": (1e-8, 3e-5, 0.002), "dp2cp2": (1e-8, 1.2e-4, 0.004)}
    path = _profile(tmp_path, cfg, per_token)
    result = choose(_cfg(*TIGHT, f"parallel.hotspa.profile={path}"))
    assert result["strategies"][0] == "dp4" and "dp2cp2" not in result["strategies"]
    assert result["strategies"][-1] == "tp2pp2" and len(result["buckets"]) >= 2
    assert set(result["chosen"]["fit"]) == set(per_token)  # only what the profile measured
    run = [*TIGHT, f"parallel.hotspa.profile={path}"]
    container = resolve_hotspa_auto(_cfg(*run), OmegaConf.to_container(compose(run)), tmp_path)
    validate_run(typed_config(container))  # the chosen strategies run without the profile
    assert json.loads((tmp_path / "hotspa_plan.json").read_text())["profile"] == str(path)


def test_a_profile_of_another_setting_is_refused(tmp_path):
    cfg = _cfg(*TIGHT)
    other = _profile(tmp_path, cfg, {"dp4": (0, 1e-5, 0)}, world=8)
    with pytest.raises(ConfigError, match="measured with another world than this run"):
        choose(_cfg(*TIGHT, f"parallel.hotspa.profile={other}"))
    with pytest.raises(ConfigError, match="cannot be read"):
        choose(_cfg(*TIGHT, f"parallel.hotspa.profile={tmp_path}/none.json"))
    with pytest.raises(ConfigError, match="is read by parallel.hotspa.strategies=\\[auto\\] only"):
        validate_run(_cfg("parallel=hotspa", f"parallel.hotspa.profile={other}"))
