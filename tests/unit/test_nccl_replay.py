"""The NCCL replay in validate_schedule: the executor's old post order deadlocks interleaved 1F1B and ZBV
under NCCL's rules, today's order is accepted for every schedule and every multi-unit layout, and a
channel whose sends and receives disagree is rejected."""

import pytest

from disttrain_core.config import compose, group_options
from disttrain_core.parallel.broker import ACT
from disttrain_core.parallel.plan import pipeline_broker, pipeline_schedule, validate_pipeline
from disttrain_core.parallel.resolved import resolve_run
from disttrain_core.parallel.units import build_layout
from disttrain_core.schedule.generators import build_schedule
from disttrain_core.schedule.replay import Call, Compute, Post, Wait, executor_programs, replay
from disttrain_core.schedule.simulator import ScheduleError
from disttrain_core.schedule.transfers import RowRouting, plan_all
from disttrain_core.schedule.validate import validate_schedule


def posted_on_one_communicator(plans):
    """How the executor posted before the fix: an action's outputs were sent with the next action's
    receives, all in one batch_isend_irecv call on the WORLD communicator; the call was waited on when it
    held receives (under NCCL that waits for its sends too: one handle per call)."""
    programs = {}
    for rank, steps in plans.items():
        items, pending, sent = [], [], []
        for step in steps:
            receives = [t for batch in step.receives.values() for t in batch]
            if pending or receives:
                call = Call(rank, "world", sends=pending, receives=receives)
                items.append(Post(call))
                sent += [call] if pending else []
                items += [Wait(call)] if receives else []
            items.append(Compute(step.action))
            pending = list(step.sends)
        if pending:
            call = Call(rank, "world", sends=pending)
            items.append(Post(call))
            sent.append(call)
        programs[rank] = items + [Wait(call) for call in sent]
    return programs


def programs_of(schedule, legacy: bool):
    plans = plan_all(schedule, RowRouting(schedule))
    return posted_on_one_communicator(plans) if legacy else executor_programs(plans)


@pytest.mark.parametrize("name, vpp", [("interleaved_1f1b", 2), ("zbv", 2)])
def test_the_old_post_order_deadlocks_under_nccl(name, vpp):
    schedule = build_schedule(name, 2, 4, vpp)
    with pytest.raises(ScheduleError, match="deadlocks under NCCL"):
        replay(programs_of(schedule, legacy=True))
    replay(programs_of(schedule, legacy=False))  # the same schedule as the executor posts it now


def test_the_old_post_order_was_fine_for_one_stage_per_rank():
    """Why gloo never showed it: GPipe, 1F1B and ZB-H1 replay clean even in the old order."""
    for name in ("gpipe", "1f1b", "zb_h1"):
        for pp, m in ((2, 4), (4, 8)):
            replay(programs_of(build_schedule(name, pp, m), legacy=True))


def test_every_generated_schedule_replays_clean():
    """pp 2-8, vpp 2-4 (interleaved; 2 breadth-first), microbatches 1-32: the data flow and the NCCL replay
    pass for every schedule at every count it accepts (ZB-H2 from 2 pp - 1, DualPipeV from 2 pp)."""
    checked = 0
    for pp in range(2, 9):
        for m in range(1, 33):
            for name in ("gpipe", "1f1b", "zb_h1", "zbv", "zb_h2", "dualpipev"):
                if name == "zb_h2" and m < 2 * pp - 1 or name == "dualpipev" and m < 2 * pp:
                    continue
                validate_schedule(build_schedule(name, pp, m, 2 if name in ("zbv", "dualpipev") else 1))
                checked += 1
            for vpp in (2, 3, 4):
                if m % pp == 0:
                    validate_schedule(build_schedule("interleaved_1f1b", pp, m, vpp))
                    checked += 1
            if m >= pp:
                validate_schedule(build_schedule("breadth_first", pp, m, 2))
                checked += 1
    assert checked == 1055 + 168 + 161 + 196


LAYOUTS = [  # (encoder, llm, generator) as (dp, tp, pp); samples per microbatch
    ((2, 1, 1), (3, 1, 1), (1, 1, 1), 6),
    ((2, 2, 1), (3, 2, 2), (1, 1, 1), 6),
    ((1, 2, 2), (2, 4, 3), (2, 1, 1), 4),
    ((4, 1, 1), (2, 2, 2), (4, 2, 1), 8),
    ((16, 2, 1), (16, 4, 4), (16, 1, 1), 16),
]


@pytest.mark.parametrize("sizes", LAYOUTS, ids=[str(layout[:3]) for layout in LAYOUTS])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "zb_h2"])
def test_multi_unit_layouts_replay_clean(sizes, name):
    encoder, llm, generator, samples = sizes
    layout = build_layout({"encoder": encoder, "llm": llm, "generator": generator}, True, True, False, False)
    rows = sum(unit.pp for unit in layout.units)
    for m in (1, 2, 3, 8):
        if name != "zb_h2" or m >= 2 * rows - 1:
            validate_pipeline(layout, build_schedule(name, rows, m), samples)


@pytest.mark.parametrize("preset", [p for p in group_options("parallel") if p != "auto"])
def test_every_parallel_preset_replays_clean_at_full_size(preset):
    """Every shipped layout, with its routing unreduced (every rank of every data-parallel replica)."""
    cfg = compose([f"parallel={preset}"])
    if cfg.schedule.name == "none":  # presets like pp2 leave the schedule to the command line
        cfg = compose([f"parallel={preset}", "schedule=1f1b"])
    layout = resolve_run(cfg).layout
    if sum(unit.pp for unit in layout.units) == 1:
        pytest.skip("one pipeline stage: no point-to-point transfers")
    samples = cfg.optim.micro_batch_size * layout.llm.dp
    microbatches = cfg.optim.global_batch_size // samples
    schedule = pipeline_schedule(cfg, layout, microbatches)
    broker, _ = pipeline_broker(layout, schedule, samples)
    validate_schedule(schedule, broker)


def test_a_channel_whose_receives_disagree_with_its_sends_is_rejected():
    schedule = build_schedule("gpipe", 2, 2)
    programs = programs_of(schedule, legacy=False)
    calls = [item.call for item in programs[1] if isinstance(item, Post) and item.call.receives]
    calls[0].receives, calls[1].receives = calls[1].receives, calls[0].receives  # rank 1 expects 1 before 0
    with pytest.raises(ScheduleError, match="receives activation for stage 1 microbatch 0 .* into the buffer for"):
        replay(programs)


def test_the_brokers_remembered_pieces_follow_each_steps_image_counts():
    """The broker remembers its answers per boundary and rank; image rows depend on the step's image counts, so a
    new step's counts must give new rows (and text rows stay the same objects)."""
    layout = build_layout({"encoder": (1, 1, 1), "llm": (1, 1, 2)}, True, False, False, False)
    broker, _ = pipeline_broker(layout, build_schedule("gpipe", 3, 2), 2)
    encoder_rank = layout.units[0].rank_at(0, 0, 0)
    broker.set_counts([[1, 2], [3, 1]])
    first = [broker.outgoing(ACT, 0, k, encoder_rank) for k in (0, 1)]
    assert [len(p.rows) for pieces in first for p in pieces] == [3, 4]
    broker.set_counts([[2, 2], [0, 1]])
    again = [broker.outgoing(ACT, 0, k, encoder_rank) for k in (0, 1)]
    assert [len(p.rows) for pieces in again for p in pieces] == [4, 1]
    last = layout.units[1].rank_at(0, 0, 1)  # the LLM's second stage: text rows from its first
    assert broker.incoming(ACT, 2, 0, last) is broker.incoming(ACT, 2, 1, last)  # one answer for every microbatch
