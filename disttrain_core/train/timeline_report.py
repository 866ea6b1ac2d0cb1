"""Measured pipeline timelines, next to what the calibrated simulator predicts.

At every logged step (with ``trainer.record_timeline=true``) each rank of the
first pipeline writes the actions it ran with their start and end times
(relative to a barrier just before the step), rank 0 draws the measured timeline
above the simulated one calibrated from those durations, writes
``timelines/step_<N>.png`` and ``timelines/step_<N>.json`` (measured and
predicted pipeline time, the measured actions) and logs the picture to TensorBoard.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from ..schedule.actions import Action, Schedule
from ..schedule.calibrate import predict
from ..schedule.simulator import TimedAction
from ..schedule.timeline import plot_timelines, png_to_array
from .metrics import MetricsLogger


class TimelineReporter:
    def __init__(
        self,
        run_dir: Path,
        rank: int,
        pipeline_ranks: list[int],
        schedule: Schedule,
        barrier: Callable[[], None],
        metrics: MetricsLogger,
    ):
        self.dir = Path(run_dir) / "timelines"
        self.rank = rank
        self.pipeline_ranks = pipeline_ranks  # global ranks of the first pipeline, by pipeline rank
        self.schedule = schedule
        self.barrier = barrier
        self.metrics = metrics
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
        self.last: dict = {}

    def wants(self, step: int, log_every: int, stop_at: int) -> bool:
        return step % log_every == 0 or step == stop_at

    def report(self, step: int, timeline: list[TimedAction], step_time_s: float | None = None) -> None:
        if self.rank in self.pipeline_ranks:
            records = [{"rank": t.rank, "action": str(t.action), "start": t.start, "end": t.end} for t in timeline]
            path = self.dir / f"step_{step:08d}.rank{self.rank:05d}.json"
            path.write_text(json.dumps(records))
        self.barrier()
        if self.rank != 0:
            return
        measured = []
        for rank in self.pipeline_ranks:
            part = self.dir / f"step_{step:08d}.rank{rank:05d}.json"
            measured += [
                TimedAction(r["rank"], Action.parse(r["action"]), r["start"], r["end"])
                for r in json.loads(part.read_text())
            ]
            part.unlink()
        started = time.perf_counter()
        simulated, span = predict(self.schedule, measured)
        name = f"{self.schedule.name} pp={self.schedule.num_ranks} m={self.schedule.num_microbatches}"
        png = plot_timelines(
            [
                (f"measured, step {step}: {name} | {1000 * span:.1f} ms", measured),
                (
                    f"simulated with measured durations: {1000 * simulated.makespan:.1f} ms "
                    f"(bubble {simulated.bubble_fraction:.1%})",
                    simulated.timeline,
                ),
            ],
            self.dir / f"step_{step:08d}.png",
            self.schedule.num_ranks,
            show_stage=self.schedule.num_stages > self.schedule.num_ranks,
            unit="seconds",
        )
        self.last = {
            "step": step,
            "measured_s": span,
            "predicted_s": simulated.makespan,
            "predicted_over_measured": simulated.makespan / span if span else None,
            "simulated_bubble_fraction": simulated.bubble_fraction,
            "png": str(png),
            "report_seconds": time.perf_counter() - started,
            # what a held-out prediction needs (tools/bench_pipeline.py): the schedule and the measured actions
            "schedule": {
                "name": self.schedule.name,
                "pp": self.schedule.num_ranks,
                "microbatches": self.schedule.num_microbatches,
                "stages": self.schedule.num_stages,
            },
            "measured": [{"rank": t.rank, "action": str(t.action), "start": t.start, "end": t.end} for t in measured],
        }
        (self.dir / f"step_{step:08d}.json").write_text(json.dumps(self.last, indent=1))
        self.metrics.log_image("pipeline/timeline", png_to_array(png), step)
