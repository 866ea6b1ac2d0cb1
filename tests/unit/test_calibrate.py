"""Held-out calibration (schedule/calibrate.py): durations measured under one schedule predict another with
the same stages. Timelines here come from the simulator with known per-stage costs, so a correct transfer
reproduces the target's simulation exactly and a wrong one does not."""

import pytest

from disttrain_core.schedule.actions import Kind
from disttrain_core.schedule.calibrate import fit, predict_from, transferred
from disttrain_core.schedule.generators import build_schedule
from disttrain_core.schedule.simulator import simulate

# heterogeneous stages: stage 1 twice as slow; I and W unequal
COSTS = {Kind.F: [1.0, 2.0], Kind.I: [0.7, 1.5], Kind.W: [0.5, 0.9]}


def _duration(action):
    if action.kind == Kind.B:
        return COSTS[Kind.I][action.stage] + COSTS[Kind.W][action.stage]
    return COSTS[action.kind][action.stage]


def _measured(name: str, p2p: float = 0.05):
    schedule = build_schedule(name, 2, 6)
    return schedule, simulate(schedule, _duration, p2p=p2p).timeline


def test_a_split_backward_calibration_predicts_whole_backward_schedules_exactly():
    source, steps = _measured("zb_h1")
    calibration = fit(source, [steps, steps])
    assert calibration.p2p == pytest.approx(0.05)
    assert calibration.means[(1, Kind.I)] == pytest.approx(1.5)
    for name in ("1f1b", "gpipe"):
        target = build_schedule(name, 2, 6)
        expected = simulate(target, _duration, p2p=0.05).makespan
        assert predict_from(target, calibration).makespan == pytest.approx(expected, rel=1e-9), name
        # B is I + W of its own stage, not of another
        table = transferred(target, calibration).table
        assert table["1B0"] == pytest.approx(2.4) and table["0B0"] == pytest.approx(1.2)


def test_what_a_calibration_cannot_say_is_refused():
    source, steps = _measured("1f1b")
    calibration = fit(source, [steps])
    with pytest.raises(ValueError, match="a split backward cannot be derived from a whole one"):
        transferred(build_schedule("zb_h1", 2, 6), calibration)
    with pytest.raises(ValueError, match="ran 2 stages and interleaved_1f1b runs 4"):
        transferred(build_schedule("interleaved_1f1b", 2, 6, vpp=2), calibration)


def test_bench_pipeline_predicts_every_schedule_from_every_other_with_its_stages():
    """tools/bench_pipeline.py's held-out table from step reports as train.py writes them (simulated here)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "bench_pipeline.py"
    spec = importlib.util.spec_from_file_location("bench_pipeline", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    def reports(name: str, vpp: int = 1):
        schedule = build_schedule(name, 2, 6, vpp)

        def cost(action):  # by stage alone; I = W = B / 2
            return (1.0 + 0.5 * (action.stage % 2)) * (0.5 if action.kind in (Kind.I, Kind.W) else 1.0)

        timeline = simulate(schedule, cost, p2p=0.01).timeline
        record = {
            "schedule": {"name": name, "pp": 2, "microbatches": 6, "stages": schedule.num_stages},
            "measured": [{"rank": t.rank, "action": str(t.action), "start": t.start, "end": t.end} for t in timeline],
        }
        return [record, record]

    recorded = {name: reports(name) for name in ("gpipe", "1f1b", "zb_h1")}
    recorded["interleaved_1f1b"] = reports("interleaved_1f1b", vpp=2)
    recorded["zbv"] = reports("zbv")
    result = tool.held_out(recorded)
    pairs = {(p["calibrated_on"], p["predicted"]): p for p in result["pairs"]}
    # 2-stage schedules among themselves, 4-stage ones among themselves; never across
    assert ("1f1b", "interleaved_1f1b") not in pairs and ("zbv", "gpipe") not in pairs
    assert "not_derivable" in pairs[("1f1b", "zb_h1")] and "not_derivable" in pairs[("interleaved_1f1b", "zbv")]
    # a duration that depends on the stage alone, I = W = B / 2: every derivable pair is exact here
    derivable = [p for p in result["pairs"] if "not_derivable" not in p]
    assert len(derivable) == 5 and result["steps_predicted"] == 10
    assert result["worst_abs_error"] == pytest.approx(0.0, abs=1e-9)
