"""Measure t(row) of HotSPa strategies on this machine: the profile ``parallel.hotspa.strategies=[auto]``
chooses from (``parallel.hotspa.profile=<out>``) instead of the planner's analytic costs.

Per strategy, one ``python train.py parallel=hotspa`` run with the strategy on three buckets of ``lengths``
(default model.seq_len / 8, / 2 and model.seq_len), ``data.packing.source=dense`` (every row one document
of exactly its bucket's length), ``rows`` rows per replica in every bucket and each bucket's rows timed
(``parallel.hotspa.time_buckets``). A bucket of r rows per replica on a pipeline of pp stages takes
(r + pp - 1) row times (its fill and drain), so t(L) = bucket seconds / (r + pp - 1), the median over the
steps after ``skip``; t(row) = a sum s^2 + b sum s + c is solved through the three points (planner/hotspa.py
``fit_row_time``). ``sync_s``: the step's time outside its buckets and switches (gradient reduction and the
optimizer). The memory limit is lifted for these runs: only time is measured here; which strategy holds
which bucket stays the memory model's answer when auto chooses.

The profile names what it was measured with (model shape, precision, recompute, processes, nodes, CPU or GPU
model); auto refuses a profile of another setting. Pass the run's own overrides after the options:

    python tools/profile_hotspa.py out=outputs/hotspa_profile.json model.seq_len=1024 parallel.recompute=full
    python train.py parallel=hotspa 'parallel.hotspa.strategies=[auto]' data.packing.buckets=null \\
        parallel.hotspa.profile=outputs/hotspa_profile.json model.seq_len=1024 parallel.recompute=full
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disttrain_core.config import REPO_ROOT  # noqa: E402
from disttrain_core.launch.cli import split_tool_args, tool_main  # noqa: E402

OPTIONS = {
    "strategies": "auto",  # comma-separated, or auto: every (dp, tp, pp, cp) the runtime accepts at every length
    "lengths": "auto",  # three row lengths, or auto: model.seq_len / 8, / 2, model.seq_len
    "rows": "2",  # rows per data-parallel replica in each bucket
    "steps": "3",
    "skip": "1",
    "out": str(REPO_ROOT / "outputs" / "hotspa_profile.json"),
    "format": "text",
}


def _config(extra: list[str]):
    from disttrain_core.config import compose, typed_config

    return typed_config(compose(["parallel=hotspa", "parallel.hotspa.strategies=[auto]", *extra]))


def plan(options: dict[str, str], cfg) -> tuple[list[int], list]:
    """(the three lengths, the strategies to measure) for the run ``cfg`` describes."""
    from disttrain_core.parallel.switch_plan import Strategy
    from disttrain_core.planner.hotspa_auto import candidate_strategies, runs_on

    seq_len = int(cfg.model.seq_len)
    if options["lengths"] == "auto":
        lengths = [max(seq_len // 8, 16), max(seq_len // 2, 32), seq_len]
    else:
        lengths = sorted(int(n) for n in options["lengths"].split(","))
    if len(set(lengths)) != 3 or lengths[-1] > seq_len:
        raise SystemExit(f"lengths={options['lengths']}: give three different lengths up to model.seq_len={seq_len}")
    world = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    if options["strategies"] == "auto":
        strategies = [s for s in candidate_strategies(world) if all(runs_on(cfg, s, n) for n in lengths)]
    else:
        strategies = [Strategy.parse(s) for s in options["strategies"].split(",")]
    if not strategies:
        raise SystemExit(f"no strategy over {world} processes runs rows of {lengths} tokens")
    return lengths, strategies


def measure(strategy, lengths: list[int], options: dict[str, str], extra: list[str], run_dir: Path) -> dict:
    from disttrain_core.planner.hotspa import fit_row_time

    rows, skip = int(options["rows"]), int(options["skip"])
    buckets = ",".join(str(n) for n in lengths)
    args = [
        "parallel=hotspa",
        "data=longtail_text",
        *extra,
        f"parallel.hotspa.strategies=[{strategy.name},{strategy.name},{strategy.name}]",
        "parallel.hotspa.home=null",
        "parallel.hotspa.time_buckets=true",
        "parallel.hotspa.profile=null",
        "data.packing.source=dense",
        f"data.packing.buckets=[{buckets}]",
        f"data.packing.documents_per_step={3 * rows * strategy.dp}",
        "data.packing.rows_per_microbatch=1",
        "data.packing.tokens_per_microbatch=null",
        "cluster.memory_per_device_gb=1000000",  # time only: fitting is the memory model's question
        f"trainer.max_steps={options['steps']}",
        "trainer.log_every_n_steps=1",
        "trainer.checkpoint.every_n_steps=0",
        "trainer.progress_bar=false",
        f"hydra.run.dir={run_dir}",
    ]
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), *args], capture_output=True, text=True, timeout=1800
    )
    if done.returncode != 0:
        raise SystemExit(f"{strategy.name}: train.py failed:\n{done.stderr[-2000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kept = [m for m in metrics if m["step"] > skip] or metrics
    fill = rows + strategy.pp - 1
    row_s = {n: statistics.median(m[f"perf/bucket_s/{n}"] for m in kept) / fill for n in lengths}
    sync = statistics.median(
        m["perf/step_time_s"] * (1 - m["perf/switch_fraction"]) - sum(m[f"perf/bucket_s/{n}"] for n in lengths)
        for m in kept
    )
    a, b, c = fit_row_time(lengths, [row_s[n] for n in lengths])
    return {"a": a, "b": b, "c": c, "sync_s": max(sync, 0.0), "row_s": {str(n): t for n, t in row_s.items()}}


def main(argv: list[str]) -> int:
    from disttrain_core.planner.hotspa_auto import PROFILE_FORMAT, profile_identity

    options, extra = split_tool_args(argv, OPTIONS)
    cfg = _config(extra)
    lengths, strategies = plan(options, cfg)
    world = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    result = {
        "format": PROFILE_FORMAT,
        "command": "python tools/profile_hotspa.py " + " ".join(argv),
        "identity": profile_identity(cfg, world),
        "lengths": lengths,
        "rows_per_replica": int(options["rows"]),
        "strategies": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for k, strategy in enumerate(strategies):
            entry = measure(strategy, lengths, options, extra, Path(tmp) / strategy.name)
            result["strategies"][strategy.name] = entry
            if options["format"] == "text":
                times = ", ".join(f"{n}: {entry['row_s'][str(n)] * 1e3:.1f} ms" for n in lengths)
                print(f"[{k + 1}/{len(strategies)}] {strategy.name}: row time {times}", flush=True)
    out = Path(options["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if options["format"] == "json":
        print(json.dumps(result, indent=1))
    print(f"-> {out}", file=sys.stderr if options["format"] == "json" else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
