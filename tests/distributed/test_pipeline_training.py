"""train.py with pipeline layouts: same losses as one process, a calibrated simulator that
predicts the measured timeline, and checkpoints that move between layouts."""

import json
import statistics

import pytest

from ..conftest import cli_overrides, read_metrics, run_train

pytestmark = pytest.mark.distributed

TEXT = [
    "model=llama_tiny",
    "trainer.precision=32",
    "optim.global_batch_size=8",
    "optim.micro_batch_size=2",
    "trainer.checkpoint.every_n_steps=0",
]


def losses(run_dir):
    return [m["loss"] for m in read_metrics(run_dir)]


def train(shards, run_dir, *overrides):
    result = run_train(cli_overrides(shards, run_dir) + list(overrides))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_pipelined_text_model_matches_one_process(shards, tmp_path):
    """1F1B (the schedule a pipeline layout gets when none is named, as ``parallel=pp2`` alone, which says so),
    ZB-H1, ZB-H2, DualPipeV (both directions of the V on each of the 2 ranks) and breadth-first interleaved
    1F1B on 2 processes: the losses of one process within 1e-5."""
    reference = losses(train(shards, tmp_path / "one", *TEXT, "trainer.max_steps=5"))
    for named in (
        [],
        ["schedule=zb_h1"],
        ["schedule=zb_h2"],
        ["schedule=dualpipev"],
        ["schedule=breadth_first", "schedule.vpp=2"],
    ):
        run_dir = tmp_path / (named[0].split("=")[1] if named else "default")
        train(shards, run_dir, *TEXT, "trainer.max_steps=5", "parallel=pp2", *named, "trainer.devices=2")
        assert losses(run_dir) == pytest.approx(reference, abs=1e-5), named
        if not named:
            log = (run_dir / "train.log").read_text()
            assert "schedule=1f1b: the layout has 2 pipeline stages and names no schedule" in log
            assert "\n  name: 1f1b\n" in (run_dir / "config.yaml").read_text()


def test_calibrated_simulator_predicts_the_measured_pipeline_time(shards, tmp_path):
    run = train(
        shards,
        tmp_path / "timeline",
        "parallel=pp2",
        "schedule=1f1b",
        "trainer.devices=2",
        "trainer.max_steps=8",
        "trainer.log_every_n_steps=2",
        "trainer.record_timeline=true",
        "optim.global_batch_size=16",
        "optim.micro_batch_size=4",
    )
    reports = [json.loads(p.read_text()) for p in sorted((run / "timelines").glob("step_*.json"))]
    assert [r["step"] for r in reports] == [2, 4, 6, 8]
    assert all((run / "timelines" / f"step_{r['step']:08d}.png").is_file() for r in reports)
    ratio = statistics.median(r["predicted_over_measured"] for r in reports[1:])  # step 2 still warms up
    assert 0.85 <= ratio <= 1.15, reports
    tags = {m.get("perf/pipeline_predicted_s") is not None for m in read_metrics(run)}
    assert tags == {True}


@pytest.mark.slow  # 33 s; DDP -> 1F1B stages is one pair of test_reshard.py's slow matrix too
def test_checkpoint_from_data_parallel_resumes_in_a_pipeline_layout(shards, tmp_path):
    straight = losses(train(shards, tmp_path / "straight", *TEXT, "trainer.max_steps=6"))
    moved = tmp_path / "moved"
    train(shards, moved, *TEXT, "trainer.max_steps=6", "trainer.exit_after_step=3")
    train(
        shards,
        moved,
        *TEXT,
        "trainer.max_steps=6",
        "trainer.resume=auto",
        "parallel=pp2",
        "schedule=1f1b",
        "trainer.devices=2",
    )
    resumed = {m["step"]: m["loss"] for m in read_metrics(moved)}
    assert [resumed[s] for s in (4, 5, 6)] == pytest.approx(straight[3:], abs=1e-5)


def test_bf16_stage_boundaries_under_bf16_mixed(shards, tmp_path):
    """bf16-mixed sends bf16 across stages by default (half the bytes); the receiving stage computes in
    fp32 again, so only the boundary is rounded: the losses follow the fp32-wire run closely."""
    common = [*TEXT, "trainer.max_steps=3", "parallel=pp2", "schedule=1f1b", "trainer.devices=2"]
    common = [o for o in common if o != "trainer.precision=32"] + ["trainer.precision=bf16-mixed"]
    wire = {
        dtype: losses(train(shards, tmp_path / dtype, *common, f"parallel.comm.wire_dtype={dtype}"))
        for dtype in ("fp32", "auto")
    }
    assert wire["auto"] != wire["fp32"]  # bf16 really travelled
    assert wire["auto"] == pytest.approx(wire["fp32"], rel=1e-2)
