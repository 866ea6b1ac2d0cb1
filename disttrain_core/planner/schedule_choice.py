"""Which pipeline schedule a planned layout runs (``planner.schedules``), and what each costs in time.

The solver evaluates a pipelined layout under every schedule the settings allow and the layout can run
(``candidates``), with each one's activations in flight (planner/breakdown.py ``in_flight``) and, for the
schedules that split a backward into I and W, without FSDP2's shard modes (the runtime refuses them:
validation/layout.py); the fastest that fits wins.

Time. 1F1B's step is the fill (one microbatch through every stage, the LLM's at 1/vpp under interleaving)
plus (m - 1) times the slowest stage (planner/evaluate.py). A zero-bubble schedule keeps the steady part and
charges a share of 1F1B's bubble -- the fill beyond the slowest stage, ``sum(t) - max(t)`` at whole-stage
times -- which the simulator gives on a uniform pipeline with t_F = t_I = t_W (a stage's backward 2 t_F):

* zb_h1, zb_h2: 1/3 ((p-1)(t_F+t_I-t_W) and, in a synchronized step, (p-1) t_F, of (p-1)(t_F+t_B));
* dualpipev: 1/6 (its F&B pairs in sequence, as the executor runs them);
* zbv: 1/4 (its greedy order measures 1/6 to 0.27 of 1F1B's bubble over pp 2-16).

tests/unit/test_planner_schedules.py holds each against the simulator. Known simplification: the first
stage cannot split its backward (data enters it directly: schedule/executor.py), which the share ignores.
"""

from __future__ import annotations

from ..schedule.generators import (  # noqa: F401  (PLANNABLE re-exported)
    LOOPED,
    PLANNABLE,
    SPLIT_BACKWARD,
    V_SHAPED,
    min_microbatches,
)

DEFAULT = ("1f1b", "interleaved_1f1b")  # what plans ran before the other schedules existed
BUBBLE_SHARE = {"zb_h1": 1 / 3, "zb_h2": 1 / 3, "zbv": 1 / 4, "dualpipev": 1 / 6}


def candidates(allowed: tuple[str, ...], vpp: int, single_unit: bool, stages: int, m: int) -> list[str]:
    """The allowed schedules a layout can run: ``vpp`` the LLM's stages per rank, ``single_unit`` whether the
    pipeline is the LLM's alone (V-shaped and breadth-first ones run only there), ``stages`` its rows, ``m``
    microbatches per step; in ``allowed``'s order. Each needs what schedule/generators.py asks."""
    names = []
    for name in allowed:
        if vpp == 1:
            fits = name in ("1f1b", "zb_h1", "zb_h2")
        elif name in LOOPED:
            fits = name == "interleaved_1f1b" or single_unit
        else:
            fits = vpp == 2 and name in V_SHAPED and single_unit
        if fits and m >= min_microbatches(name, stages):
            names.append(name)
    return names


def splits_backward(schedule: str) -> bool:
    return schedule in SPLIT_BACKWARD


def pipeline_s(schedule: str, stages: list[tuple[str, float]], vpp: int, m: int) -> float:
    """Seconds of one step's pipeline (before the gradient sync): ``stages`` = (unit, seconds per microbatch)
    in pipeline order, ``vpp`` the LLM's stages per rank."""
    slowest = max(t for _, t in stages)
    fill = sum(t / (vpp if name == "llm" and schedule in LOOPED else 1) for name, t in stages)
    one_f_one_b = fill + (m - 1) * slowest
    share = BUBBLE_SHARE.get(schedule)
    if share is None:
        return one_f_one_b
    bubble = sum(t for _, t in stages) - slowest
    return m * slowest + share * bubble


def filled_pipeline_s(
    schedule: str, stages: list[tuple[str, float]], encoder_s: float, m: int, split: tuple[int, ...] | None = None
) -> float:
    """``pipeline_s`` of a single-unit pipeline whose first stage's colocated encoder (``encoder_s`` of its seconds
    per microbatch) runs in chunks of ``split`` blocks (None: even) in the bubbles (schedule.fill_bubbles,
    schedule/bubble_fill.py): the 1F1B formula scaled by the simulator's ratio of the filled step to the colocated
    one on these stage times (forward a third of each, as the rest of this model counts)."""
    from ..schedule.bubble_fill import StageDurations, fill_bubbles
    from ..schedule.generators import build_schedule
    from ..schedule.simulator import simulate

    times = [t for _, t in stages]
    ranks = len(times)
    base = build_schedule(schedule, ranks, m)
    colocated = StageDurations([t / 3 for t in times], [2 * t / 3 for t in times])
    llm = [times[0] - encoder_s, *times[1:]]
    shares = [n / sum(split) for n in split] if split else [1.0 / ranks] * ranks
    chunks = [encoder_s * share for share in shares]
    filled = StageDurations([t / 3 for t in chunks + llm], [2 * t / 3 for t in chunks + llm])
    ratio = simulate(fill_bubbles(base, filled), filled).makespan / simulate(base, colocated).makespan
    return pipeline_s(schedule, stages, 1, m) * ratio
