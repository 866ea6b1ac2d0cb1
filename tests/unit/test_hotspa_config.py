"""parallel=hotspa and data.packing are refused before launch, in one line, when a strategy does not span
the run, a strategy cannot hold its bucket in the memory limit, buckets and strategies disagree in number,
buckets are not ascending or reach beyond model.seq_len, or the model is not a text-only Llama; and the
home is the strategy with the least model state per process."""

import pytest

from disttrain_core.config import compose, typed_config
from disttrain_core.parallel.switch_plan import Strategy
from disttrain_core.planner.fit import validate_run
from disttrain_core.validation import ConfigError

HOT = ["parallel=hotspa", "data.packing.buckets=[64,256,1024]", "model.seq_len=1024"]


def _cfg(*overrides):
    return typed_config(compose(list(overrides)))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.hotspa.strategies=[dp4,dp2tp2]"], "2 strategies for 3 buckets"),
        (["parallel.hotspa.strategies=[dp4,dp2tp2,tp2]"], "tp2 uses 2 processes but the run has 4"),
        (["parallel.hotspa.strategies=[dp4,dp2tp2,tp3dp1]"], "uses 3 processes"),
        (["parallel.hotspa.strategies=[dp4,dp2tp2,xx2]"], "write it as factors like dp2tp2"),
        (["parallel.hotspa.home=pp4"], "parallel.hotspa.home='pp4' is none of the strategies"),
        (["data.packing.buckets=[256,64,1024]"], "strictly ascending"),
        (["data.packing.buckets=[64,256,2048]"], "reach beyond model.seq_len=1024"),
        (  # measured by the planner's memory model: dp4 needs 55 MB at 1,024 tokens, tp2pp2 22 MB
            [
                "parallel.hotspa.strategies=[tp2pp2,dp2tp2,dp4]",
                "cluster.runtime_overhead_gb=0",
                "cluster.memory_per_device_gb=0.04",
            ],
            "strategy dp4 cannot hold its bucket of 1024-token rows",
        ),
        (["model=mllm_tiny"], "use a text-only model"),
        (["data=synthetic_laion"], "parallel.mode=hotspa runs packed variable-length text"),
        (["schedule=interleaved_1f1b", "schedule.vpp=2"], "one pipeline stage per rank"),
        (["trainer.record_timeline=true"], "a HotSPa step runs one per bucket"),
        (["parallel.hotspa.recompute=[none,full]"], "has 2 policies for 3 buckets"),
        (["parallel.hotspa.recompute=[none,full,often]"], "'often' is not one of none, full"),
        (["data.packing.tokens_per_microbatch=0"], "data.packing.tokens_per_microbatch=0: use a positive token"),
        (["data.packing.length_scale=-1"], "data.packing.length_scale=-1.0: use a positive factor"),
    ],
)
def test_bad_hotspa_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")) as error:
        validate_run(_cfg(*HOT, *overrides))
    assert "\n" not in str(error.value)


def test_the_same_limit_accepts_strategies_that_shard_the_long_bucket():
    validate_run(_cfg(*HOT, "cluster.runtime_overhead_gb=0", "cluster.memory_per_device_gb=0.04"))


def test_a_bucket_that_recomputes_fits_where_it_did_not():
    """The memory check reads each bucket's own recompute policy: dp4 holds 1,024-token rows at 0.04 GB only
    when its bucket recomputes every block, whatever the other buckets do; the engine builds it so."""
    from disttrain_core.parallel.hotspa_layout import bucket_recompute, strategy_config

    tight = [*HOT, "parallel.hotspa.strategies=[tp2pp2,dp2tp2,dp4]", "cluster.runtime_overhead_gb=0"]
    tight.append("cluster.memory_per_device_gb=0.04")
    with pytest.raises(ConfigError, match="dp4 cannot hold its bucket"):
        validate_run(_cfg(*tight, "parallel.hotspa.recompute=[full,full,none]"))
    cfg = _cfg(*tight, "parallel.hotspa.recompute=[none,none,full]")
    validate_run(cfg)
    assert [bucket_recompute(cfg, k) for k in range(3)] == ["none", "none", "full"]
    assert strategy_config(cfg, Strategy.parse("dp4"), 1024, bucket_recompute(cfg, 2)).parallel.recompute == "full"


def test_the_default_preset_validates_and_its_home_is_the_most_sharded():
    from disttrain_core.parallel.hotspa_layout import bucket_strategies

    cfg = _cfg("parallel=hotspa")
    validate_run(cfg)
    strategies, capacities, home = bucket_strategies(cfg)
    assert [s.name for s in strategies] == ["dp4", "dp2tp2", "tp2pp2"] and capacities == [64, 128, 256]
    assert home == "tp2pp2"
    assert bucket_strategies(_cfg("parallel=hotspa", "parallel.hotspa.home=dp2tp2"))[2] == "dp2tp2"


def test_packing_with_a_static_layout_is_ddp_only():
    with pytest.raises(ConfigError, match="parallel.mode=ddp, hotspa or local_sgd"):
        validate_run(
            _cfg("model=llama_tiny", "data=longtail_text", "parallel=pp2", "schedule=1f1b", "trainer.devices=2")
        )
    validate_run(_cfg("model=llama_tiny", "data=longtail_text", "trainer.devices=2"))
