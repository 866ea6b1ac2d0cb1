"""Draw disttrain_core's layers and one run's flow (docs/ARCHITECTURE.md), from the code itself.

    python tools/architecture.py            # docs/results/architecture_layers.png, docs/results/run_flow.png

The layers are import-linter's contract (.importlinter, checked by make test); the arrows between them are
counted from the imports of every file (function-level imports included), so the picture cannot drift from the
code: an import that ran up the layers would fail the contract before it could be drawn.
"""

from __future__ import annotations

import configparser
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.import_graph import import_graph  # noqa: E402

OUT = ROOT / "docs" / "results"

ROLES = {
    "launch": "front door: launch(cfg), ranks, SLURM, producer CLI",
    "planner": "cost + memory model, Algorithm 1, memory fit",
    "validation": "one-line config errors before any process",
    "train": "loop, engines, checkpoints, local SGD, HotSPa",
    "parallel": "units, FSDP2/ZeRO, TP, CP, EP, broker, switches",
    "models": "single-device modules: ViT, Llama, MoE, U-Net",
    "data": "shards, producer, packing, reordering",
    "schedule": "pipeline schedules, executor, simulator",
    "comm": "collectives, p2p, ring attention, traces",
    "config": "typed schema, composition",
    "base": "torch versions, clocks, sockets, processes",
}


def layers() -> list[list[str]]:
    parser = configparser.ConfigParser()
    parser.read(ROOT / ".importlinter")
    lines = parser["importlinter:contract:layers"]["layers"].strip().splitlines()
    return [[name.strip().split(".")[-1] for name in line.split("|")] for line in lines]


def package_edges() -> Counter:
    edges = Counter()
    for source, targets in import_graph().items():
        for target in targets:
            a, b = (source.split(".") + [""])[1], (target.split(".") + [""])[1]
            if a != b and a and b:
                edges[(a, b)] += 1
    return edges


def draw_layers(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = layers()
    edges = package_edges()
    fig, ax = plt.subplots(figsize=(13, 0.7 * len(rows) + 1))
    place = {}
    for level, row in enumerate(rows):
        y = len(rows) - level
        for k, name in enumerate(row):
            width = 4.2 / len(row)
            x = 0.3 + k * (width + 0.1)
            ax.add_patch(plt.Rectangle((x, y - 0.32), width, 0.64, facecolor="#dbe9f6", edgecolor="#2b5d8a"))
            ax.text(x + 0.08, y + 0.08, name, fontsize=11, weight="bold", va="center")
            ax.text(x + 0.08, y - 0.15, ROLES.get(name, ""), fontsize=7.5, va="center", color="#333333")
            place[name] = (x + width, y)
    for level, row in enumerate(rows):
        parts = []
        for name in row:
            uses = sorted(((b, n) for (a, b), n in edges.items() if a == name), key=lambda item: -item[1])
            if uses:
                prefix = f"{name}: " if len(row) > 1 else ""
                parts.append(prefix + "imports " + ", ".join(f"{b} {n}" for b, n in uses))
        ax.text(4.75, len(rows) - level, "; ".join(parts), fontsize=7.5, va="center", color="#555555")
    total = sum(edges.values())
    ax.set_title(
        f"disttrain_core: {len(place)} packages in layers, each importing only those below it; {total} imports between "
        "packages (files x targets), checked by import-linter (.importlinter)",
        fontsize=10,
    )
    ax.set_xlim(0, 9.5)
    ax.set_ylim(0.4, len(rows) + 0.6)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FLOW = [
    ("train.py", "preflight: every sweep variant composed + validated (launch/cli.py)"),
    ("launch(cfg)", "launch/entry.py: environment, device defaults, validate_run (validation/ + planner/fit.py)"),
    ("parallel=auto", "planner: profile or analytic costs -> Algorithm 1 -> the chosen layout"),
    ("ResolvedRun", "resolve_run, once (parallel/resolved.py): devices, layout, HotSPa buckets, plan"),
    ("start ranks", "fork server / Fabric / elastic agent (launch/launchers.py); data producer"),
    ("each rank", "launch/worker.py: the ResolvedRun, Fabric, process groups, Trainer (train/loop.py)"),
    ("Trainer", "run.layout -> broker + schedule (parallel/, schedule/), engine (train/engines.py)"),
    ("each step", "microbatches (data/) -> executor -> optimizer -> metrics, checkpoints"),
    ("summary.json", "the sweeper's metric; TensorBoard, timelines, memory reports"),
]


def draw_flow(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.62 * len(FLOW) + 0.6))
    for k, (name, what) in enumerate(FLOW):
        y = len(FLOW) - k
        ax.add_patch(plt.Rectangle((0.1, y - 0.25), 1.6, 0.5, facecolor="#fde9cf", edgecolor="#a86200"))
        ax.text(0.18, y, name, fontsize=10, weight="bold", va="center")
        ax.text(1.85, y, what, fontsize=9, va="center")
        if k + 1 < len(FLOW):
            ax.annotate("", xy=(0.9, y - 0.62), xytext=(0.9, y - 0.26), arrowprops={"arrowstyle": "->"})
    ax.set_title("One run, from the command line to its results", fontsize=11)
    ax.set_xlim(0, 8)
    ax.set_ylim(0.4, len(FLOW) + 0.5)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    draw_layers(OUT / "architecture_layers.png")
    draw_flow(OUT / "run_flow.png")
    print(f"wrote {OUT / 'architecture_layers.png'} and {OUT / 'run_flow.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
