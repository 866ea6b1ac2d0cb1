"""How much gradient and parameter traffic the overlapped collectives hide (issue 7).

ZeRO-1 data parallelism on 2 ranks, trained three ways on the same data:

* ``overlap``      gradient buckets reduce-scattered during backward, parameter buckets
                   all-gathered during the next forward (parallel.comm defaults);
* ``no_overlap``   the same collectives after backward and right after the step;
* ``compute_only`` every collective replaced by the local copy it would produce
                   (``parallel.comm.skip_collectives``): the step without communication.

hidden fraction = (T_no_overlap - T_overlap) / (T_no_overlap - T_compute_only), and the
communication share of the non-overlapped step = (T_no_overlap - T_compute_only) / T_no_overlap.

Networks: ``emulated`` runs one rank per emulated node (tools/netem_cluster.py: network
namespaces, veth, tbf at ``rate``; needs root and iproute2, skipped with a note otherwise),
each node on a core of its own (``pin=true``, the default): a real node's communication takes
its own CPU, never the other node's. With ``pin=false`` the kernel may run either node's
threads on either core, so one rank's communication can slow the other rank's computation;
``loopback`` runs both ranks in one launcher over 127.0.0.1. Each rank gets one CPU thread
(``trainer.threads_per_rank=1``), so the two ranks own the two cores.

This shared machine's speed drifts by 10-20% over tens of seconds, more than the differences
measured. So by default (``method=interleaved``) the three modes take turns inside one run, in
blocks of ``block`` steps (``parallel.comm.interleave_modes``): every mode sees the same machine
phase. The first cycle is warm-up and the first step of every block is not timed (its forward
used parameters gathered the previous mode's way). ``rounds`` runs are made; a mode's step time
is the median over all its timed steps, and the hidden fraction of every round is reported too.
``method=separate`` runs each mode on its own (``steps`` steps, ``warmup`` untimed), as the first
version of this benchmark did. One more traced run per mode on the emulated network gives the
picture (compute and communication lanes of rank 0 over two steps).

The CPU a ring step costs (tools/ring_cost.py: one reduce-scatter and one all-gather of a ``bucket_mb``
bucket on the same network, nothing computing beside them) is measured once per network and scaled to a
training step by the model's gradient bytes: on two cores that CPU is taken from the computation and
cannot be hidden.

    sudo python tools/bench_overlap.py                  # ~6 minutes on 2 cores
    python tools/bench_overlap.py network=loopback format=json
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from disttrain_core.comm.engine import MODES as COMM_MODES
from disttrain_core.comm.engine import interleaved_mode
from disttrain_core.config import REPO_ROOT
from disttrain_core.launch.cli import split_tool_args

OPTIONS = {
    "method": "interleaved",  # interleaved (modes take turns in one run) | separate (a run per mode)
    "block": "4",  # interleaved: steps per turn; the first of each turn is not timed
    "cycles": "4",  # interleaved: turns per mode in a run; the first cycle is warm-up
    "steps": "12",  # separate: steps per run
    "warmup": "4",  # separate: untimed steps per run
    "rounds": "3",
    "rate": "1gbit",
    "delay": "0.1ms",
    "pin": "true",  # emulated: node k's processes run on core k only (netem_cluster pin=true)
    "bucket_mb": "2",
    "micro_batch": "3",  # per rank; one microbatch per step (global batch = 2 x micro_batch)
    "network": "both",  # both | emulated | loopback
    "format": "text",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_overlap.json"),
    "picture": str(REPO_ROOT / "docs" / "results" / "bench_overlap.png"),  # none: no traced runs
}

# A plain Llama (5.9M parameters, 23.6 MB of fp32 gradients) and one microbatch of micro_batch x 256
# tokens per rank: with 3, its ZeRO-1 traffic at 1 Gbit/s is about 35% of the non-overlapped step here
# (with 4, about 28-30%: too close to the 30% the issue asks for).
MODEL = [
    "model=llama_tiny",
    "model.llm.dim=256",
    "model.llm.n_layers=8",
    "model.llm.ffn_dim=704",
    "model.llm.n_heads=8",
    "model.llm.n_kv_heads=4",
]
# The switches of each mode, as overrides (the same table parallel.comm.interleave_modes uses).
MODES = {
    mode: [f"parallel.comm.{name}={str(value).lower()}" for name, value in switches.items()]
    for mode, switches in COMM_MODES.items()
}


def emulation_available() -> str | None:
    """None when the emulated cluster can run here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    return None


def train(network: str, mode: str, run_dir: Path, options: dict, trace: bool = False) -> list[dict]:
    """One training run; ``mode`` is a key of MODES or ``interleaved`` (all of them taking turns)."""
    if mode == "interleaved":
        steps = int(options["cycles"]) * len(MODES) * int(options["block"])
        switches = [
            f"parallel.comm.interleave_modes=[{','.join(MODES)}]",
            f"parallel.comm.interleave_block={options['block']}",
        ]
    else:
        steps, switches = int(options["steps"]), MODES[mode]
    common = [
        f"hydra.run.dir={run_dir}",
        *MODEL,
        f"optim.micro_batch_size={options['micro_batch']}",
        f"optim.global_batch_size={2 * int(options['micro_batch'])}",
        "parallel=zero1",
        f"parallel.comm.bucket_mb={options['bucket_mb']}",
        *switches,
        f"parallel.comm.trace={str(trace).lower()}",
        f"trainer.max_steps={steps}",
        "trainer.threads_per_rank=1",
        "trainer.log_every_n_steps=1",
        "trainer.progress_bar=false",
        "trainer.checkpoint.every_n_steps=0",
        "trainer.checkpoint.save_last=false",
    ]
    train_py = [sys.executable, str(REPO_ROOT / "train.py")]
    if network == "emulated":
        cluster = [
            sys.executable,
            str(REPO_ROOT / "tools" / "netem_cluster.py"),
            "nodes=2",
            f"rate={options['rate']}",
            f"delay={options['delay']}",
            f"pin={options['pin']}",
            "timeout=900",
            "--",
        ]
        args = cluster + train_py + common + ["trainer.num_nodes=2", "trainer.devices=1"]
    else:
        args = train_py + common + ["trainer.num_nodes=1", "trainer.devices=2"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=1200, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{network}/{mode} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def ring_cost(network: str, options: dict) -> dict:
    """tools/ring_cost.py on ``network`` at the bucket size, and its CPU scaled to one training step."""
    tool = [sys.executable, str(REPO_ROOT / "tools" / "ring_cost.py"), f"bucket_mb={options['bucket_mb']}"]
    if network == "emulated":
        tool = [sys.executable, str(REPO_ROOT / "tools" / "netem_cluster.py"), "nodes=2", f"rate={options['rate']}",
                f"delay={options['delay']}", f"pin={options['pin']}", "timeout=300", "--", *tool]  # fmt: skip
    done = subprocess.run(tool, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise SystemExit(f"ring_cost on {network} failed:\n{done.stderr[-3000:]}")
    cost = json.loads(done.stdout.strip().splitlines()[-1])
    from disttrain_core.config import compose
    from disttrain_core.models.info import model_info

    params = model_info(compose(MODEL).model)["total_params"]
    buckets = 4 * params / (float(options["bucket_mb"]) * 2**20)  # fp32 gradients and parameters
    per_bucket = cost["reduce_scatter"]["cpu_ms"] + cost["all_gather"]["cpu_ms"]
    cost["buckets_per_step"] = buckets
    cost["cpu_ms_per_step"] = per_bucket * buckets  # one reduce-scatter and one all-gather per bucket
    return cost


def interleaved_times(metrics: list[dict], options: dict) -> dict[str, list[float]]:
    """Step times of an interleaved run by mode, without the first cycle and each turn's first step
    (whose forward used parameters gathered the previous mode's way)."""
    block, modes = int(options["block"]), list(MODES)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for m in metrics:
        step = m["step"]
        if step > len(modes) * block and (step - 1) % block:
            times[interleaved_mode(modes, block, step)].append(m["perf/step_time_s"])
    return times


def summarize(times: dict[str, list[float]]) -> dict:
    step = {mode: statistics.median(values) for mode, values in times.items()}
    comm = step["no_overlap"] - step["compute_only"]
    return {
        "step_s": step,
        "step_s_all": times,
        "communication_s": comm,
        "communication_share_of_no_overlap": comm / step["no_overlap"],
        "hidden_fraction": (step["no_overlap"] - step["overlap"]) / comm if comm > 0 else None,
        "speedup_overlap_vs_no_overlap": step["no_overlap"] / step["overlap"],
    }


def draw(traces: dict[str, Path], warmup: int, path: Path, title: str) -> Path:
    """Rank 0's compute and communication lanes over two typical consecutive steps, per mode.

    The pair drawn is the one (after the warm-up) whose duration is closest to the median pair, so a
    hiccup of this shared machine is not what the picture shows.
    """
    from disttrain_core.comm.trace import plot_trace

    panels = []
    for mode, run_dir in traces.items():
        events = json.loads((run_dir / "comm_trace" / "rank00000.json").read_text())
        steps = [e for e in events if e["lane"] == "step"][warmup:]
        pairs = [(steps[i], steps[i + 1]) for i in range(len(steps) - 1)]
        typical = statistics.median(b["end"] - a["start"] for a, b in pairs)
        first, second = min(pairs, key=lambda p: abs(p[1]["end"] - p[0]["start"] - typical))
        start, end = first["start"], second["end"]
        window = [
            {**e, "start": max(e["start"], start) - start, "end": min(e["end"], end) - start}
            for e in events
            if e["end"] > start and e["start"] < end and (e["lane"] != "step" or e in (first, second))
        ]
        span = 1000 * (end - start) / 2
        panels.append((f"{title}: {mode.replace('_', ' ')} ({span:.0f} ms per step, traced)", window))
    return plot_trace(panels, path)


def main(argv: list[str]) -> int:
    options, _ = split_tool_args(argv, OPTIONS)
    if options["method"] not in ("interleaved", "separate"):
        raise SystemExit(f"method={options['method']!r}: use interleaved or separate")
    if options["pin"].lower() not in ("true", "false"):
        raise SystemExit(f"pin={options['pin']!r}: use true or false")
    warmup, rounds = int(options["warmup"]), int(options["rounds"])
    networks = ["emulated", "loopback"] if options["network"] == "both" else [options["network"]]
    why_not = emulation_available()
    results: dict = {
        "model_overrides": MODEL,
        "layout": "parallel=zero1 (2 ranks, 1 thread each)",
        "bucket_mb": float(options["bucket_mb"]),
        "micro_batch_per_rank": int(options["micro_batch"]),
        "method": options["method"],
        "rounds": rounds,
        **(
            {"block": int(options["block"]), "cycles": int(options["cycles"])}
            if options["method"] == "interleaved"
            else {"steps": int(options["steps"]), "warmup_steps": warmup}
        ),
        "networks": {},
    }
    out = Path(options["out"]).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for network in networks:
            if network == "emulated" and why_not:
                results["networks"]["emulated"] = {"skipped": why_not}
                print(f"emulated network skipped: {why_not}", file=sys.stderr)
                continue
            times: dict[str, list[float]] = {mode: [] for mode in MODES}
            per_round = []
            for round_ in range(rounds):
                if options["method"] == "interleaved":
                    metrics = train(network, "interleaved", Path(tmp) / f"{network}_{round_}", options)
                    measured = interleaved_times(metrics, options)
                else:
                    measured = {}
                    for mode in MODES:
                        metrics = train(network, mode, Path(tmp) / f"{network}_{mode}_{round_}", options)
                        measured[mode] = [m["perf/step_time_s"] for m in metrics if m["step"] > warmup]
                for mode in MODES:
                    times[mode] += measured[mode]
                per_round.append(summarize(measured)["hidden_fraction"])
                if options["format"] != "json":
                    medians = "  ".join(f"{mode} {statistics.median(measured[mode]):.3f} s" for mode in MODES)
                    hidden = "n/a" if per_round[-1] is None else f"{per_round[-1]:.0%}"  # no communication seen
                    print(f"{network:9s} round {round_}: {medians}  hidden {hidden}", flush=True)
            entry = summarize(times)
            entry["hidden_fraction_per_round"] = per_round
            entry["ring_cost"] = ring_cost(network, options)
            if network == "emulated":
                entry["rate"], entry["delay"] = options["rate"], options["delay"]
                entry["pinned"] = options["pin"].lower() == "true"
            if network == "emulated" and options["picture"] != "none":
                traces = {}
                for mode in ("no_overlap", "overlap"):
                    traces[mode] = Path(tmp) / f"trace_{mode}"
                    train(network, mode, traces[mode], options, trace=True)
                picture = draw(traces, warmup, Path(options["picture"]).resolve(), f"2 nodes, {options['rate']}")
                entry["picture"] = (
                    str(picture.relative_to(REPO_ROOT)) if picture.is_relative_to(REPO_ROOT) else str(picture)
                )
            results["networks"][network] = entry
    out.write_text(json.dumps(results, indent=1))
    if options["format"] == "json":
        print(json.dumps(results))
    else:
        for network, entry in results["networks"].items():
            if "skipped" in entry:
                print(f"{network}: skipped ({entry['skipped']})")
                continue
            s = entry["step_s"]
            hidden = entry["hidden_fraction"]
            print(
                f"{network:9s} overlap {s['overlap']:.3f}s  no overlap {s['no_overlap']:.3f}s  compute only "
                f"{s['compute_only']:.3f}s  communication {100 * entry['communication_share_of_no_overlap']:.0f}% of "
                f"the step, hidden {'n/a' if hidden is None else f'{100 * hidden:.0f}%'}"
            )
            rounds_ = [f"{100 * h:.0f}%" for h in entry["hidden_fraction_per_round"] if h is not None]
            cost = entry["ring_cost"]
            rs, ag = cost["reduce_scatter"]["cpu_ms"], cost["all_gather"]["cpu_ms"]
            print(
                f"{'':9s} hidden per round {', '.join(rounds_)}; CPU per ring step ({cost['bucket_mb']:g} MB bucket) "
                f"reduce-scatter {rs:.2f} ms, all-gather {ag:.2f} ms: {cost['cpu_ms_per_step']:.0f} ms a training step"
            )
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
