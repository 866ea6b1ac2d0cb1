"""Simulate a pipeline schedule and draw its timeline.

    python tools/simulate.py schedule=1f1b pp=4 microbatches=8
    python tools/simulate.py schedule=interleaved_1f1b pp=4 microbatches=8 vpp=2 format=json
    python tools/simulate.py schedule=zb_h1 pp=4 microbatches=8 t_f=1 t_i=1 t_w=1 t_p2p=0.05
    python tools/simulate.py schedule=dualpipev pp=4 microbatches=16 vpp=2 t_fb=2.4
    python tools/simulate.py csv=my_schedule.csv t_f=1 t_b=2

Durations are per microbatch through one rank's share of the model (t_f forward, t_b full
backward, t_i / t_w the two halves of a split backward, t_p2p per cross-rank hop); with
several stages per rank (vpp) each stage action takes 1/vpp of them. ``t_fb``: the time of one
overlapped forward+backward pair of DualPipeV (in the same units; empty: the pair runs in sequence,
as this repository's executor runs it). Defaults: t_f=1 t_b=2 t_i=1 t_w=1 t_p2p=0. The table ends
with each rank's idle time inside its own first-to-last span (zero for ZB-H2 at equal times: what a
step costs when consecutive steps tile). ``format=json`` prints
{"makespan", "bubble_fraction", "peak_activations", ...}; a PNG Gantt chart is written to
``out`` (default outputs/simulate/<schedule>_pp<pp>_m<microbatches>.png).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from disttrain_core.launch.cli import split_tool_args
from disttrain_core.schedule.actions import Schedule
from disttrain_core.schedule.generators import build_schedule
from disttrain_core.schedule.simulator import Durations, ScheduleError, simulate
from disttrain_core.schedule.timeline import plot_timelines
from disttrain_core.schedule.validate import validate_schedule

OPTIONS = {
    "schedule": "1f1b",
    "pp": "4",
    "microbatches": "8",
    "vpp": "1",
    "t_f": "1",
    "t_b": "2",
    "t_i": "1",
    "t_w": "1",
    "t_p2p": "0",
    "t_fb": "",
    "format": "table",
    "out": "",
    "csv": "",
}


def main(argv: list[str]) -> int:
    options, rest = split_tool_args(argv, OPTIONS)
    if rest:
        print(
            f"error: unknown argument(s) {' '.join(rest)}; accepted: {', '.join(f'{k}=' for k in OPTIONS)}",
            file=sys.stderr,
        )
        return 2
    try:
        if options["csv"]:
            schedule = Schedule.from_csv(options["csv"])
        else:
            schedule = build_schedule(
                options["schedule"], int(options["pp"]), int(options["microbatches"]), int(options["vpp"])
            )
        validate_schedule(schedule)
        per_rank_stages = schedule.num_stages // schedule.num_ranks
        scale = 1.0 / per_rank_stages
        durations = Durations(
            forward=float(options["t_f"]) * scale,
            backward=float(options["t_b"]) * scale,
            backward_input=float(options["t_i"]) * scale,
            backward_weight=float(options["t_w"]) * scale,
            forward_backward=float(options["t_fb"]) * scale if options["t_fb"] else None,
        )
        result = simulate(schedule, durations, p2p=float(options["t_p2p"]))
    except (ValueError, ScheduleError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    tag = f"{schedule.name}_pp{schedule.num_ranks}_m{schedule.num_microbatches}"
    tag += f"_v{per_rank_stages}" if per_rank_stages > 1 else ""
    out = Path(options["out"] or Path("outputs") / "simulate" / f"{tag}.png")
    title = (
        f"{schedule.name}: pp={schedule.num_ranks} microbatches={schedule.num_microbatches} "
        f"stages/rank={per_rank_stages} | makespan {result.makespan:.2f} | bubble {result.bubble_fraction:.1%}"
    )
    plot_timelines([(title, result.timeline)], out, schedule.num_ranks, show_stage=per_rank_stages > 1)
    summary = {
        "schedule": schedule.name,
        "pp": schedule.num_ranks,
        "microbatches": schedule.num_microbatches,
        "stages_per_rank": per_rank_stages,
        **result.summary(),
        "png": str(out),
    }
    if options["format"] == "json":
        print(json.dumps(summary, indent=1))
    else:
        print(schedule.format())
        print(
            f"makespan {result.makespan:.3f} | bubble fraction {result.bubble_fraction:.4f} "
            f"(per rank: {', '.join(f'{b:.3f}' for b in result.bubble_fraction_per_rank)})"
        )
        print(f"peak in-flight activations per rank: {result.peak_activations}")
        print(f"idle inside each rank's own span: {', '.join(f'{idle:.3f}' for idle in result.span_idle)}")
        print(f"critical path: {' -> '.join(result.critical_path)}")
        print(f"timeline: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
