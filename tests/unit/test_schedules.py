"""Schedules as data: closed forms, memory, CSV interop with torch, validation, simulation."""

import pytest
from torch.distributed.pipelining.schedules import _Action as TorchAction

from disttrain_core.schedule.actions import Action, Kind, Schedule
from disttrain_core.schedule.generators import build_schedule, interleaved_1f1b
from disttrain_core.schedule.simulator import Durations, ScheduleError, simulate
from disttrain_core.schedule.validate import validate_schedule

GRID = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]
UNIT = Durations(forward=1.0, backward=2.0, backward_input=1.0, backward_weight=1.0)


def bubble(schedule, stages_per_rank=1):
    scale = 1.0 / stages_per_rank
    durations = Durations(forward=scale, backward=2 * scale, backward_input=scale, backward_weight=scale)
    return simulate(schedule, durations)


@pytest.mark.parametrize("p, m", GRID)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(p, m):
    for name in ("gpipe", "1f1b"):
        assert bubble(build_schedule(name, p, m)).bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=0.01)


@pytest.mark.parametrize("p, m", GRID)
@pytest.mark.parametrize("v", [1, 2])
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p, m, v):
    result = bubble(interleaved_1f1b(p, m, v), stages_per_rank=v)
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=0.01)


@pytest.mark.parametrize("p, m", GRID)
def test_zero_bubble_h1_closed_form_and_zbv_below_it(p, m):
    zb = bubble(build_schedule("zb_h1", p, m))
    assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), rel=0.01)
    zbv = bubble(build_schedule("zbv", p, m, vpp=2), stages_per_rank=2)
    assert zbv.bubble_fraction < zb.bubble_fraction
    # Both keep 1F1B's peak memory: p full-stage activations (2p half-stage ones for the V).
    assert max(zb.peak_activations) == p and max(zbv.peak_activations) == 2 * p


@pytest.mark.parametrize("p, m", GRID)
def test_peak_in_flight_activations(p, m):
    assert bubble(build_schedule("gpipe", p, m)).peak_activations == [m] * p
    assert bubble(build_schedule("1f1b", p, m)).peak_activations == [p - r for r in range(p)]


def test_every_generated_schedule_validates():
    for name, vpp in (
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved_1f1b", 2),
        ("interleaved_1f1b", 3),
        ("zb_h1", 1),
        ("zbv", 2),
    ):
        for p, m in GRID:
            validate_schedule(build_schedule(name, p, m, vpp))


def test_actions_use_torch_notation_and_torch_parses_our_csv(tmp_path):
    for text in ("0F1", "1B0", "0I2", "0W2", "3SEND_F1", "1RECV_B0"):
        assert str(Action.parse(text)) == text
    schedule = build_schedule("zb_h1", 4, 8)
    path = tmp_path / "zb.csv"
    schedule.to_csv(path)
    for row, line in zip(schedule.actions, path.read_text().splitlines(), strict=True):
        for ours, cell in zip(row, line.split(","), strict=True):
            theirs = TorchAction.from_str(cell)
            assert (theirs.stage_index, theirs.computation_type.name, theirs.microbatch_index) == (
                ours.stage,
                {"F": "FORWARD", "I": "BACKWARD_INPUT", "W": "BACKWARD_WEIGHT", "B": "FULL_BACKWARD"}[ours.kind.value],
                ours.microbatch,
            )
    loaded = Schedule.from_csv(path)
    assert loaded.actions == schedule.actions and loaded.stage_to_rank == schedule.stage_to_rank


def test_csv_with_idle_cells_and_v_placement_round_trips(tmp_path):
    path = tmp_path / "v.csv"
    path.write_text("0F0,,3F0,3B0,0B0\n1F0,2F0,2B0,1B0,\n")
    schedule = Schedule.from_csv(path)
    assert schedule.stage_to_rank == [0, 1, 1, 0]
    validate_schedule(schedule)
    assert simulate(schedule, UNIT).makespan == pytest.approx(4 * 1 + 4 * 2)


def _one_f_one_b_rows():
    return [
        [Action(0, Kind.F, 0), Action(0, Kind.F, 1), Action(0, Kind.B, 0), Action(0, Kind.B, 1)],
        [Action(1, Kind.F, 0), Action(1, Kind.B, 0), Action(1, Kind.F, 1), Action(1, Kind.B, 1)],
    ]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda rows: rows[0].pop(), "has B=0"),  # a missing backward
        (lambda rows: rows[1].append(Action(1, Kind.F, 1)), "2 forwards"),  # a duplicate
        (lambda rows: rows[0].insert(0, Action(1, Kind.F, 0)), "lives on rank 1"),  # wrong placement
        (lambda rows: rows[1].insert(0, rows[1].pop(1)), "backward before the forward"),
        (
            lambda rows: (
                rows.__setitem__(
                    1, [Action(1, Kind.F, 1), Action(1, Kind.B, 1), Action(1, Kind.F, 0), Action(1, Kind.B, 0)]
                )
                or rows.__setitem__(
                    0, [Action(0, Kind.F, 0), Action(0, Kind.B, 0), Action(0, Kind.F, 1), Action(0, Kind.B, 1)]
                )
            ),
            "deadlocks",
        ),
        (lambda rows: rows[0].append(Action(0, Kind.F, 5)), "microbatch in"),
    ],
)
def test_validator_catches_broken_schedules(mutate, message):
    rows = _one_f_one_b_rows()
    mutate(rows)
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(Schedule("broken", 2, [0, 1], rows))


def test_split_w_before_its_i_is_caught():
    rows = [[Action(0, Kind.F, 0), Action(0, Kind.W, 0), Action(0, Kind.I, 0)]]
    with pytest.raises(ScheduleError, match="W before its I"):
        validate_schedule(Schedule("w-first", 1, [0], rows))


def test_heterogeneous_stages_and_microbatches():
    """A slow first stage (an image encoder, say) and one heavy microbatch stretch the pipeline."""
    schedule = build_schedule("1f1b", 3, 6)
    even = simulate(schedule, UNIT)
    skewed = simulate(
        schedule, Durations(forward=1.0, backward=2.0, per_stage=[3.0, 1.0, 1.0], per_microbatch=[1, 1, 4, 1, 1, 1])
    )
    assert skewed.makespan > even.makespan
    assert skewed.bubble_fraction_per_rank[1] > even.bubble_fraction_per_rank[1]  # the fast ranks wait
    assert skewed.critical_path[-1].endswith("0B5")  # the pipeline ends with the first stage's last backward
    assert simulate(schedule, UNIT, p2p=0.5).makespan > even.makespan


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: build_schedule("pipedream", 2, 4), "unknown"),
        (lambda: build_schedule("interleaved_1f1b", 4, 6, vpp=2), "multiple of pp"),
        (lambda: build_schedule("interleaved_1f1b", 2, 4, vpp=1), "vpp >= 2"),
        (lambda: build_schedule("1f1b", 2, 4, vpp=2), "stage\\(s\\) per rank"),
    ],
)
def test_bad_schedule_requests_are_explained(call, message):
    with pytest.raises(ValueError, match=message):
        call()
