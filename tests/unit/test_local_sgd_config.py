"""parallel=local_sgd and optim=sgd are refused before launch, in one line, for a shard group that does not
divide the world, sync_every < 1, an unknown method, outer settings out of range, layouts local SGD does not
shard, and an SGD optimizer where the sharded AdamW runs."""

import pytest

from disttrain_core.config import compose, typed_config
from disttrain_core.planner.fit import validate_run
from disttrain_core.validation import ConfigError

LOCAL = ["parallel=local_sgd", "trainer.devices=4", "optim.micro_batch_size=2"]


def _cfg(*overrides):
    return typed_config(compose(list(overrides)))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.local_sgd.shard_group=3"], "shard_group=3 does not divide the 4 processes"),
        (["parallel.local_sgd.sync_every=0"], "sync_every=0: use 1 or more"),
        (["parallel.local_sgd.method=edit_v2"], "method='edit_v2': allowed values are diloco, post_local_sgd, edit"),
        (["parallel.local_sgd.method=a_edit"], "a_edit syncs every sync_interval_s seconds (it is None)"),
        (["parallel.local_sgd.method=a_edit", "parallel.local_sgd.sync_interval_s=0"], "(it is 0.0)"),
        (["parallel.local_sgd.sync_interval_s=60"], "sync_interval_s=60.0 is A-EDiT's"),
        (
            ["parallel.local_sgd.method=a_edit", "parallel.local_sgd.sync_interval_s=900"],
            "trainer.stop_grace_s=600.0 is shorter than parallel.local_sgd.sync_interval_s=900.0",
        ),
        (["parallel.local_sgd.step_weight=0.5"], "step_weight=0.5 weights A-EDiT's workers by their steps"),
        (
            [
                "parallel.local_sgd.method=a_edit",
                "parallel.local_sgd.sync_interval_s=1",
                "parallel.local_sgd.step_weight=2",
            ],
            "step_weight=2.0: use",
        ),
        (["trainer.straggler.ranks=[4]", "trainer.threads_per_rank=1"], "trainer.straggler.ranks: 4 is not a rank"),
        (["trainer.straggler.factor=0.5"], "trainer.straggler.factor"),
        (["trainer.straggler.ranks=[1]"], "set trainer.threads_per_rank=1"),
        (["parallel.local_sgd.offload=true"], "on CPU they are in host memory already"),
        (
            ["parallel.local_sgd.offload=true", "parallel.local_sgd.shard_group=2", "parallel.shard=zero3"],
            "on CPU they are in host memory already",  # FSDP2 workers offload too, on CUDA
        ),
        (["parallel.local_sgd.warmup_steps=-1"], "warmup_steps=-1"),
        (["parallel.local_sgd.outer_lr=0"], "outer_lr=0.0: use a positive rate"),
        (["parallel.local_sgd.outer_momentum=1.0"], "outer_momentum=1.0: use a value in [0, 1)"),
        (["parallel.tp=2"], "unset parallel.tp / pp / cp / ep"),
        (["parallel.shard=zero4"], "parallel.shard='zero4': a local-SGD worker runs none (DDP), zero1, zero2"),
        (["parallel.shard=zero3", "parallel.local_sgd.shard_group=1"], "use shard_group=2 or more"),
        (
            ["parallel.zero1=true", "parallel.local_sgd.shard_group=2", "parallel.comm.wire_dtype=bf16"],
            "set parallel.comm.wire_dtype=fp32",
        ),
        (
            ["parallel.shard=zero3", "parallel.local_sgd.shard_group=2", "parallel.hsdp_replicas=2"],
            "under local_sgd the workers are the replicas",
        ),
        (["data.producer.address=127.0.0.1:5555"], "unset data.producer.address"),
        (["parallel.local_sgd.layerwise=true", "trainer.compile=true"], "layerwise syncs in forward hooks"),
        (["parallel.local_sgd.method=edit", "trainer.compile=true"], "layerwise syncs in forward hooks"),
        (["parallel.local_sgd.penalty.ewma_alpha=0"], "penalty.ewma_alpha=0.0: use a value in (0, 1]"),
        (["parallel.local_sgd.penalty.temperature=0"], "penalty.temperature=0.0"),
        (["parallel.local_sgd.penalty.clip=-1"], "penalty.clip=-1.0: use a positive norm"),
        (["parallel.local_sgd.spikes.workers=[4]"], "spikes.workers: 4 is not a worker (0..3)"),
        (["parallel.local_sgd.spikes.probability=2"], "spikes.probability=2.0"),
    ],
)
def test_bad_local_sgd_settings_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        validate_run(_cfg(*LOCAL, *overrides))
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel=zero1"], "optim=sgd runs with parallel=dp (no sharding) or parallel=local_sgd"),
        (["parallel=megatron_tp2"], "use optim=adamw"),
        (
            ["parallel=local_sgd", "parallel.local_sgd.shard_group=2", "parallel.shard=zero1"],
            "ZeRO-1's optimizer inside local-SGD workers is AdamW",
        ),
        (["parallel=auto"], "use optim=adamw"),
        (["optim.nesterov=true"], "optim.nesterov=true needs optim.momentum > 0"),
        (["optim.momentum=1.5"], "optim.momentum"),
    ],
)
def test_sgd_where_adamw_is_sharded_fails_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        validate_run(_cfg("optim=sgd", "trainer.devices=2", "optim.micro_batch_size=2", *overrides))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_good_settings_pass():
    validate_run(_cfg(*LOCAL))
    validate_run(_cfg(*LOCAL, "parallel.local_sgd.shard_group=2", "optim=sgd", "optim.momentum=0.9"))
    two = [*LOCAL, "parallel.local_sgd.shard_group=2"]
    validate_run(_cfg(*two, "parallel.shard=zero3", "optim=sgd"))  # torch SGD on FSDP2's shards
    validate_run(_cfg(*two, "parallel.shard=zero2", "trainer.precision=bf16-mixed"))
    validate_run(_cfg(*two, "parallel.shard=zero1", "trainer.precision=bf16-mixed", "parallel.comm.wire_dtype=fp32"))
    validate_run(_cfg(*LOCAL, "parallel.local_sgd.shard_group=null", "parallel.local_sgd.method=post_local_sgd"))
    validate_run(_cfg("optim=sgd", "trainer.devices=2", "optim.micro_batch_size=2"))


@pytest.mark.parametrize(
    "method, settings, expected",
    [
        ("diloco", [], (False, False, False)),
        ("post_local_sgd", [], (False, False, False)),
        ("edit", [], (True, True, True)),
        ("a_edit", ["parallel.local_sgd.sync_interval_s=1"], (True, True, True)),
        (
            "edit",
            ["parallel.local_sgd.layerwise=false", "parallel.local_sgd.penalty.weighting=false"],
            (False, True, False),
        ),
        ("diloco", ["parallel.local_sgd.penalty.anomaly=true"], (False, True, False)),
    ],
)
def test_edit_methods_turn_on_layerwise_sync_and_the_penalty_unless_set(method, settings, expected):
    from disttrain_core.parallel.plan import local_sgd_features

    cfg = _cfg(*LOCAL, f"parallel.local_sgd.method={method}", *settings)
    validate_run(cfg)
    assert local_sgd_features(cfg.parallel.local_sgd) == expected
