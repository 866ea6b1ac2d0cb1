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


# Durations (t_F, t_I, t_W) beside unit times: a cheap weight gradient, a dear input gradient.
TIMES = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 2.0, 1.0)]


@pytest.mark.parametrize("p, m", [(p, m) for p, m in GRID if m >= 2 * p - 1])
def test_zero_bubble_h2_is_a_parallelogram(p, m):
    """ZB-H2 (Qi et al.): each rank's own span holds (p-1)(t_F+t_I-2t_W) of idle time -- none at equal times, so
    steps that are not lined up by an optimizer barrier tile without a bubble; one synchronized step waits
    only the (p-1) t_F ramp; 2p-1 microbatches in flight, twice ZB-H1's p."""
    schedule = build_schedule("zb_h2", p, m)
    for f, i, w in TIMES:
        result = simulate(schedule, Durations(forward=f, backward_input=i, backward_weight=w))
        assert max(result.span_idle) == pytest.approx((p - 1) * (f + i - 2 * w)), (f, i, w)
        assert result.makespan == pytest.approx(m * (f + i + w) + (p - 1) * f), (f, i, w)
    assert (
        max(result.peak_activations) == 2 * p - 1 == 2 * max(bubble(build_schedule("zb_h1", p, m)).peak_activations) - 1
    )


@pytest.mark.parametrize("p, m", [(p, m) for p, m in GRID if m >= 2 * p])
def test_dualpipev_bubble_is_deepseeks_closed_form(p, m):
    """DualPipe's table: (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages on p ranks, F&B one overlapped
    forward/backward pair (timed as one unit here: fully serial, perfectly overlapped, and in between);
    PP + 1 = 2p + 1 chunk activations in flight."""
    schedule = build_schedule("dualpipev", p, m, vpp=2)
    placed = [{r, 2 * p - 1 - r} for r in range(p)]
    for w in (1.0, 0.5):
        full = 1.0 + w  # t_B = t_I + t_W with t_F = t_I = 1
        for pair in (1.0 + full, max(1.0, full), 0.8 * (1.0 + full)):
            result = simulate(schedule, Durations(backward_weight=w, forward_backward=pair))
            worst = max(result.makespan - busy for busy in result.busy)
            assert worst == pytest.approx((p - 1) * (pair + full - 3 * w)), (w, pair)
    assert bubble(schedule).peak_activations == [2 * p + 1] * p
    pairs = schedule.meta["overlap"]  # each an F of one chunk and a B of the rank's other chunk
    assert all(f.kind == Kind.F and b.kind == Kind.B and {f.stage, b.stage} in placed for f, b in pairs)
    assert len(pairs) == sum(2 * m - 3 * p + r + 1 for r in range(p))  # 2(m - 2p + r + 1) main + (p - r - 1)


@pytest.mark.parametrize("p, m", GRID)
@pytest.mark.parametrize("v", [2, 3])
def test_breadth_first_keeps_the_bubble_and_holds_every_microbatch(p, m, v):
    """Breadth-first (every microbatch through chunk 0 before chunk 1): depth-first's bubble, and
    2(p-1) + (v-1)m + 1 chunk activations on rank 0 (at most all m v) instead of 2(p-1) + (v-1)p + 1."""
    breadth = bubble(build_schedule("breadth_first", p, m, v), stages_per_rank=v)
    depth = bubble(interleaved_1f1b(p, m, v), stages_per_rank=v)
    assert breadth.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=0.01)
    assert breadth.peak_activations[0] == min(2 * (p - 1) + (v - 1) * m + 1, v * m)
    assert depth.peak_activations[0] == min(2 * (p - 1) + (v - 1) * p + 1, v * m)


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
        ("breadth_first", 2),
        ("zb_h2", 1),
        ("dualpipev", 2),
    ):
        for p, m in GRID:
            if name == "dualpipev" and m < 2 * p or name == "zb_h2" and m < 2 * p - 1:
                continue  # refused below
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
        (lambda: build_schedule("zb_h2", 4, 6), "at least 2 x pp - 1 = 7 microbatches"),
        (lambda: build_schedule("dualpipev", 4, 7, vpp=2), "at least 2 x pp = 8 microbatches"),
        (lambda: build_schedule("breadth_first", 4, 2, vpp=2), "at least pp \\(4\\) microbatches"),
    ],
)
def test_bad_schedule_requests_are_explained(call, message):
    with pytest.raises(ValueError, match=message):
        call()
