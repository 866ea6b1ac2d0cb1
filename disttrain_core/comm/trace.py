"""A record of when this rank computed and when its collectives ran, and its picture.

Compute spans (pipeline actions, the optimizer, waits) are stamped on the
training thread with a ``DeviceClock`` (base/clock.py): host times on a CPU, CUDA
events on the current stream on a GPU, so a span is when the work ran, not when
it was queued; stamps become seconds when the trace is written. A collective
is stamped when it is issued and when it completes: a watcher thread waits for
each in issue order on a CPU (not every backend gives collectives a future) and
polls ``is_completed()`` on a GPU (where ``wait()`` only orders streams), so the
communication lane shows what the network really did -- including how much of
it ran under the computation.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

import torch

from ..base.clock import DeviceClock, Stamp


class CommTrace:
    def __init__(self, device: torch.device | None = None) -> None:
        self.events: list[dict] = []
        self.lock = threading.Lock()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.watcher: threading.Thread | None = None
        self.clock = DeviceClock(device or torch.device("cpu"))
        self.clock.anchor()  # ties GPU events to host time (one synchronization, when tracing starts)

    def now(self) -> Stamp:
        """When work queued now will run: read the clock at this point of the current stream."""
        return self.clock.stamp()

    def _add(self, event: dict) -> None:
        with self.lock:
            self.events.append(event)

    def compute(self, name: str, start: Stamp, end: Stamp) -> None:
        self._add({"lane": "compute", "name": name, "start": start, "end": end})

    def step(self, number: int, start: Stamp, end: Stamp) -> None:
        self._add({"lane": "step", "name": f"step {number}", "start": start, "end": end})

    def comm(self, name: str, issued: Stamp, work, nbytes: int) -> None:
        event = {"lane": "comm", "name": name, "start": issued, "end": None, "bytes": nbytes}
        if work is None:
            event["end"] = self.now()
        else:  # not every backend gives collectives a future (gloo's reduce-scatter): a thread waits
            self.queue.put((event, work))
            if self.watcher is None:
                self.watcher = threading.Thread(target=self._watch, name="comm-trace", daemon=True)
                self.watcher.start()
        self._add(event)

    def _watch(self) -> None:
        while True:
            event, work = self.queue.get()
            try:
                if self.clock.cuda:  # wait() would only make this thread's stream wait
                    while not work.is_completed():
                        time.sleep(50e-6)
                else:
                    work.wait()
            except Exception:  # the training thread sees the failure when it waits; keep tracing
                pass
            event["end"] = time.perf_counter()
            if getattr(work, "started", None) is not None:
                event["began"] = work.started  # left the queue (a ring job): start..began is queueing

    def dump(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:
            events = [e for e in self.events if e["end"] is not None]
        seconds = self.clock.seconds
        events = [{**e, "start": seconds(e["start"]), "end": seconds(e["end"])} for e in events]
        path.write_text(json.dumps(events))


_TRACE_COLORS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "optimizer": "#8172b2",
    "wait": "#c44e52",
    "reduce-scatter": "#dd8452",
    "all-gather": "#937860",
    "all-reduce": "#da8bc3",
    "other": "#999999",
}
_TRACE_LABELS = {"wait": "wait (gradients, parameters)", "other": "other (data, clip, ...)"}


def _trace_kind(name: str) -> str:
    """The colour key of an event: the first key its name starts with, else "other"."""
    for key in _TRACE_COLORS:
        if name.startswith(key):
            return key
    return "other"


def plot_trace(panels: list[tuple[str, list[dict]]], path: str | Path) -> Path:
    """One panel per run: a compute lane and a communication lane over the same time axis (ms).

    Collectives issued while an earlier one is still running queue behind it on the wire; the
    communication lane draws each from when it could start (issue, or the previous one's end) to
    its completion.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = max((max((e["end"] for e in events), default=0.0) for _, events in panels), default=1.0)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.6 * len(panels) + 0.6), squeeze=False, sharex=True)
    for ax, (title, events) in zip(axes[:, 0], panels, strict=True):
        _draw_trace_panel(ax, title, events)
    axes[-1, 0].set_xlim(0, 1000 * width)
    axes[-1, 0].set_xlabel("ms (dashed: end of a step)")
    _trace_legend(fig, panels)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_trace_panel(ax, title: str, events: list[dict]) -> None:
    """One run's communication lane (collectives queued behind each other), compute lane and step ends."""
    busy = 0.0
    for event in sorted((e for e in events if e["lane"] == "comm"), key=lambda e: e["start"]):
        start = max(event["start"], busy)
        busy = max(busy, event["end"])
        ax.barh(
            0,
            1000 * max(event["end"] - start, 0.0),
            left=1000 * start,
            height=0.7,
            color=_TRACE_COLORS[_trace_kind(event["name"])],
            edgecolor="black",
            linewidth=0.3,
        )
    for event in events:
        if event["lane"] == "compute":
            ax.barh(
                1,
                1000 * (event["end"] - event["start"]),
                left=1000 * event["start"],
                height=0.7,
                color=_TRACE_COLORS[_trace_kind(event["name"])],
                edgecolor="black",
                linewidth=0.3,
            )
        elif event["lane"] == "step":
            ax.axvline(1000 * event["end"], color="black", linewidth=0.8, linestyle="--")
    ax.set_yticks([0, 1])
    ax.set_yticklabels(["communication", "compute"])
    ax.set_ylim(-0.6, 1.6)
    ax.set_title(title, fontsize=9)


def _trace_legend(fig, panels: list[tuple[str, list[dict]]]) -> None:
    """A legend of the event kinds the panels use, below them."""
    from matplotlib.patches import Patch

    kinds = {_trace_kind(e["name"]) for _, events in panels for e in events if e["lane"] != "step"}
    used = sorted(kinds, key=list(_TRACE_COLORS).index)
    fig.legend(
        handles=[Patch(color=_TRACE_COLORS[k], label=_TRACE_LABELS.get(k, k)) for k in used],
        loc="lower center",
        ncol=len(used),
        fontsize=8,
        frameon=False,
    )
