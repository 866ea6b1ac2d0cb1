"""trainer.compile against eager, engine by engine, on this CPU (issue 39; tools/bench_kernels.py section (d),
docs/performance/training.md).

Each layout trains ``steps`` steps with trainer.compile=false and =true (train.py, the default precision: fp32 on
the CPU), alternating which goes first in each of ``repeats`` rounds. A run's tokens/s is the median of its log
windows after the first (the first holds the compile); the ratio is compiled over eager per round, reported as
the median and range over the rounds.

    python tools/bench_compile.py                          # about 10 minutes here
    python tools/bench_compile.py layouts=ddp,pp2 repeats=2
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from disttrain_core.config import REPO_ROOT
from disttrain_core.launch.cli import tool_main, tool_options

TEXT = ["model=llama_tiny"]
LAYOUTS = {
    "ddp": [*TEXT, "parallel=dp", "trainer.devices=2"],  # the DDP engine, 2 processes
    "pp2": [*TEXT, "parallel=pp2", "schedule=1f1b", "trainer.devices=2"],  # a pipeline (units engine)
    "disagg2": ["parallel=disagg2"],  # encoder unit | LLM unit (mllm_tiny)
    "fsdp2": [*TEXT, "parallel=dp", "parallel.shard=zero3", "trainer.devices=2"],  # FSDP2 zero3
}
OPTIONS = {
    "layouts": ",".join(LAYOUTS),
    "steps": "16",
    "window": "4",  # trainer.log_every_n_steps
    "repeats": "3",
    "format": "table",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_compile.json"),
}


def tokens_per_s(layout: list[str], compiled: bool, steps: int, window: int, scratch: Path) -> float:
    run_dir = scratch / f"run{len(list(scratch.iterdir()))}"
    command = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        *layout,
        f"trainer.compile={str(compiled).lower()}",
        f"trainer.max_steps={steps}",
        f"trainer.log_every_n_steps={window}",
        "trainer.checkpoint.every_n_steps=0",
        "trainer.checkpoint.save_last=false",
        "trainer.progress_bar=false",
        f"paths.output_dir={run_dir}",
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, env=dict(os.environ))
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(layout)} compile={compiled} failed: {result.stderr[-2000:]}")
    windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(w["perf/tokens_per_s"] for w in windows[1:])


def compiled_engines(options: dict) -> list[dict]:
    steps, window, repeats = int(options["steps"]), int(options["window"]), int(options["repeats"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as scratch:
        for name in options["layouts"].split(","):
            layout = LAYOUTS[name]
            eager, compiled = [], []
            for round_ in range(repeats):
                order = (False, True) if round_ % 2 == 0 else (True, False)
                for setting in order:
                    value = tokens_per_s(layout, setting, steps, window, Path(scratch))
                    (compiled if setting else eager).append(value)
                print(f"{name} round {round_ + 1}: eager {eager[-1]:,.0f}, compiled {compiled[-1]:,.0f} tokens/s")
            ratios = [c / e for c, e in zip(compiled, eager, strict=True)]
            rows.append(
                {
                    "layout": name,
                    "overrides": layout,
                    "eager_tokens_per_s": eager,
                    "compiled_tokens_per_s": compiled,
                    "compiled_over_eager_median": statistics.median(ratios),
                    "compiled_over_eager_range": [min(ratios), max(ratios)],
                }
            )
    return rows


def describe(rows: list[dict]) -> list[str]:
    return [
        f"{row['layout']}: compiled {statistics.median(row['compiled_tokens_per_s']):,.0f} / eager "
        f"{statistics.median(row['eager_tokens_per_s']):,.0f} tokens/s = {row['compiled_over_eager_median']:.2f}x "
        f"({row['compiled_over_eager_range'][0]:.2f}-{row['compiled_over_eager_range'][1]:.2f} over "
        f"{len(row['eager_tokens_per_s'])} rounds)"
        for row in rows
    ]


def main(argv: list[str]) -> int:
    options = tool_options(argv, OPTIONS)
    unknown = [n for n in options["layouts"].split(",") if n not in LAYOUTS]
    if unknown:
        print(f"error: layouts={options['layouts']}: unknown {unknown}; allowed: {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    rows = compiled_engines(options)
    result = {"options": options, "compiled_engines": rows}
    out = Path(options["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1) if options["format"] == "json" else "\n".join(describe(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
