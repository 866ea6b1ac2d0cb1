"""Monitoring: TensorBoard scalars and metrics.jsonl carry the same values; the LR schedule."""

import math

import pytest

from disttrain_core.launch.entry import launch
from disttrain_core.train.optim import lr_factor

from ..conftest import read_metrics

EXPECTED_TAGS = {
    "train/loss",
    "train/lm_loss",
    "train/gen_loss",
    "train/lr",
    "train/grad_norm",
    "perf/tokens_per_s",
    "perf/samples_per_s",
    "perf/step_time_s",
    "perf/mfu",
    "perf/peak_memory_gib",
    "perf/data_wait_fraction",
}


def test_tensorboard_and_jsonl_agree(compose_cfg, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    launch(compose_cfg("trainer.max_steps=3", run_dir=run_dir))
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert EXPECTED_TAGS <= tags, EXPECTED_TAGS - tags
    losses = [e.value for e in events.Scalars("train/loss")]
    assert losses == pytest.approx([r["loss"] for r in records], rel=1e-6)
    for record in records:
        assert 0 < record["perf/mfu"] < 1.5  # the test config claims a 100 GFLOP/s peak
        assert record["perf/tokens_per_s"] > 0 and math.isfinite(record["grad_norm"])


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    values = [lr_factor(step, warmup_steps=10, decay_steps=100, min_ratio=0.1) for step in range(120)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[10:100], values[11:101], strict=True))
    assert values[100] == pytest.approx(0.1) and values[119] == pytest.approx(0.1)


def test_same_seed_gives_bit_identical_runs(compose_cfg, tmp_path):
    losses = []
    for name in ("a", "b"):
        launch(compose_cfg("trainer.max_steps=3", run_dir=tmp_path / name))
        losses.append([r["loss"] for r in read_metrics(tmp_path / name)])
    assert losses[0] == losses[1]


def test_matmul_peak_stops_growing_at_the_time_budget():
    import time

    import torch

    from disttrain_core.train.perf import measure_matmul_peak

    started = time.perf_counter()
    assert measure_matmul_peak(torch.float32, torch.device("cpu"), size=4096, budget_s=0.05) > 0
    assert time.perf_counter() - started < 10  # a 4096-square fp32 matmul alone takes longer here


def test_bf16_peak_on_a_cpu_is_never_below_the_fp32_peak(monkeypatch):
    """Without native bf16 a CPU emulates bf16 matmuls slowly; autocast's work can still run at fp32
    speed, so the MFU denominator for bf16-mixed is the faster of the two."""
    import torch

    from disttrain_core.train import perf

    measured = {torch.bfloat16: 2.5e9, torch.float32: 79e9}
    monkeypatch.setattr(perf, "_measured", lambda dtype, device: measured[dtype])
    assert perf.peak_flops_per_device("bf16-mixed", torch.device("cpu"), None, None) == 79e9
    assert perf.peak_flops_per_device("32", torch.device("cpu"), None, None) == 79e9
    measured[torch.bfloat16] = 300e9
    assert perf.peak_flops_per_device("bf16-mixed", torch.device("cpu"), None, None) == 300e9
    assert perf.peak_flops_per_device("bf16-mixed", torch.device("cpu"), 1e12, None) == 1e12  # configured wins
