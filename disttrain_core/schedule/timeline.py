"""Gantt charts of pipeline timelines (simulated or measured): one row per rank,
one box per action coloured by kind and labelled with its microbatch, idle time
left as hatched gaps so bubbles stand out."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .actions import Kind
from .simulator import TimedAction

COLORS = {Kind.F: "#4c72b0", Kind.B: "#55a868", Kind.I: "#8fd19e", Kind.W: "#dd8452"}
LABELS = {Kind.F: "forward", Kind.B: "backward", Kind.I: "backward (input)", Kind.W: "backward (weights)"}


def _draw(ax, timeline: Sequence[TimedAction], title: str, ranks: int, show_stage: bool, unit: str) -> None:
    from matplotlib.patches import Patch

    end = max((t.end for t in timeline), default=1.0)
    # One collection per (rank, kind): a pipeline of 40 stages x 320 microbatches has ~14,000 boxes,
    # which one bar call each took 20 s to draw.
    boxes: dict[tuple[int, Kind], list[tuple[float, float]]] = {}
    for rank in range(ranks):
        ax.broken_barh([(0, end)], (rank - 0.4, 0.8), facecolors="white", edgecolor="#bbbbbb", hatch="///", linewidth=0)
    for item in timeline:
        width = item.end - item.start
        boxes.setdefault((item.rank, item.action.kind), []).append((item.start, width))
        label = f"{item.action.stage}:{item.action.microbatch}" if show_stage else str(item.action.microbatch)
        if width > end / 120:
            ax.text(
                item.start + width / 2,
                item.rank,
                label,
                ha="center",
                va="center",
                fontsize=7,
                color="white" if item.action.kind in (Kind.F, Kind.B) else "black",
            )
    for (rank, kind), spans in boxes.items():
        ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=COLORS[kind], edgecolor="black", linewidth=0.4)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)
    kinds = sorted({t.action.kind for t in timeline}, key=lambda k: list(COLORS).index(k))
    handles = [Patch(color=COLORS[k], label=LABELS[k]) for k in kinds]
    handles.append(Patch(facecolor="white", edgecolor="#bbbbbb", hatch="///", label="idle (bubble)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)


def plot_timelines(
    panels: Sequence[tuple],
    path: str | Path,
    ranks: int,
    show_stage: bool = False,
    unit: str = "time",
    share_time_axis: bool = False,
) -> Path:
    """Draw one panel per ``(title, timeline)`` -- or ``(title, timeline, rows)`` when panels have
    different row counts -- stacked vertically; write a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [panel[2] if len(panel) > 2 else ranks for panel in panels]
    heights = [0.55 * r + 1.2 for r in rows]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(13, sum(heights)),
        squeeze=False,
        sharex=share_time_axis,
        gridspec_kw={"height_ratios": heights},
    )
    for ax, panel, count in zip(axes[:, 0], panels, rows, strict=True):
        _draw(ax, panel[1], panel[0], count, show_stage, unit)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def png_to_array(path: str | Path):
    """HWC uint8 array of a PNG (for TensorBoard images)."""
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"))
