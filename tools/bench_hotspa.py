"""HotSPa against packed static training, measured here: tokens/s of ``parallel=hotspa`` and of every static
strategy that holds the longest bucket within a memory limit, alternated in one run of this tool.

Workload (fixed before measuring): a Llama of MODEL's shape; every step ``documents`` synthetic documents of
the ``source`` length profile up to ``max_len`` tokens (data/packing.py), the same documents in every run.
The profile describes 32K-context corpora (the seed's CommonCrawl runs); drawn for a 1K context it is
scaled by ``length_scale`` = max_len / 32768 (``data.packing.length_scale``: median and tail start shrink,
the shape stays), so the long tail stays a tail. Clamping the unscaled profile at 1K instead puts 82% of
the tokens into the longest bucket: then every strategy runs mostly long rows and bucketing has little to
win (measured: 1.00x; docs/performance/hotspa.md).

Networks: ``nodes=1`` runs the ``devices`` processes on this host over loopback; ``nodes=2`` splits them over
two emulated nodes (tools/netem_cluster.py: network namespaces joined by a ``rate``-shaped link; needs root
and iproute2), so switches and data-parallel reductions cross the slow link where the plans put them.

Memory limit. The planner's memory model (planner/fit.py ``strategy_memory``, runtime overhead 0)
gives the bytes pure data parallelism (dp over every process) needs at ``max_len`` with zero3 and full
recompute -- the least any pure-DP strategy needs -- and what each static candidate needs (ZeRO-1, full
recompute: every run here recomputes every block). The limit is set just below the former, so no pure-DP
strategy fits the longest bucket; a candidate runs only if it fits under it (printed). HotSPa's strategies
are validated against the same limit before its runs start.

Static candidates (``static``): by default every (dp, tp, pp, cp) over the processes that the runtime
accepts at ``max_len``. Static runs pack every document into rows of ``max_len`` (one bucket) and run one
strategy (as ``parallel=hotspa`` with one bucket: the same engine, no switching). HotSPa packs into ``buckets`` and runs
``strategies``, one per bucket. Each alternation runs HotSPa and every fitting candidate once (``python
train.py``, ``steps`` steps); a run's tokens/s is the median over its steps after the first ``skip``
(tokens that carry a label). Reported: per alternation HotSPa / the best static of that alternation, their
median and spread, and HotSPa's share of step time spent switching. With ``auto_profile`` (a
tools/profile_hotspa.py profile), each alternation also runs ``strategies=[auto]`` and reports it alike.

    python tools/bench_hotspa.py auto_profile=docs/results/hotspa_profile.json   # about 10 minutes here
    sudo python tools/bench_hotspa.py nodes=2 predict=false out=docs/results/bench_hotspa_2nodes.json
    python tools/bench_hotspa.py alternations=1 steps=3 format=json
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
    "devices": "4",
    "max_len": "1024",
    "buckets": "256,1024",
    # one per bucket; auto: parallel.hotspa.strategies=[auto] chooses buckets and strategies (with profile=)
    "strategies": "dp4,pp4",
    "profile": "none",  # auto's measured costs: a tools/profile_hotspa.py profile of this workload's settings
    # static candidates for the longest bucket; all: every (dp, tp, pp, cp) over the processes the runtime accepts
    "static": "all",
    "auto_profile": "none",  # a tools/profile_hotspa.py profile: each alternation also runs strategies=[auto]
    "documents": "256",
    "source": "commoncrawl",
    # every length of the profile x this; auto: max_len / 32768 (the seed's 32K contexts drawn for max_len)
    "length_scale": "auto",
    "nodes": "1",  # 2: the processes split over 2 emulated nodes (tools/netem_cluster.py; root and iproute2)
    "rate": "1gbit",  # the emulated nodes' link
    "delay": "0.1ms",
    "steps": "4",
    "skip": "1",
    "alternations": "3",
    "format": "text",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_hotspa.json"),
    "measure": "true",  # false: only the prediction at scale
    "predict": "true",  # the seed's setting: llama2_32b on 32 A800s, CommonCrawl-like lengths up to 32K
    "picture": str(REPO_ROOT / "docs" / "results" / "bench_hotspa.png"),  # the predicted step; none: skip
}
# The seed's setting (HotSPa's 32B run): 4 servers x 8 A800-80G, buckets and strategies of its artifact for
# 32B on 32 GPUs -- (4K, dp4 tp2 pp4), (16K, dp2 tp8 pp2), (32K, dp1 tp16 pp2) -- except that TP here stays
# inside a server (the cost model does not split TP over InfiniBand): tp16 pp2 becomes tp8 pp4.
SEED = {
    "overrides": [
        "model=llama2_32b",
        "cluster=a800_80g",
        "data=longtail_text",
        "parallel=hotspa",
        "trainer.devices=8",
        "trainer.num_nodes=4",
        "trainer.accelerator=cpu",  # composing only: nothing runs
        "trainer.precision=bf16-mixed",
        "parallel.recompute=full",
        "data.packing.buckets=[4096,16384,32768]",
        "parallel.hotspa.strategies=[dp4tp2pp4,dp2tp8pp2,tp8pp4]",
    ],
    "buckets": [4096, 16384, 32768],
    "strategies": ["dp4tp2pp4", "dp2tp8pp2", "tp8pp4"],
    "documents": 512,  # HotSPa's default global batch
    "reported": {"speedup_over_megatron_up_to": 2.99, "switch_s_32b_32gpus": "< 1"},
}


def predict_at_scale() -> dict:
    """The planner's prediction (planner/hotspa.py) for SEED, with its strategies and with the fastest
    strategy per bucket, against every static (dp, tp, pp, cp) on 32 GPUs that holds 32K tokens."""
    from disttrain_core.config import compose, typed_config
    from disttrain_core.parallel.switch_plan import Strategy
    from disttrain_core.planner.hotspa import predict, strategy_costs

    cfg = typed_config(compose(SEED["overrides"]))
    candidates = [
        Strategy(dp=32 // (tp * pp * cp), tp=tp, pp=pp, cp=cp)
        for tp in (1, 2, 4, 8)
        for pp in (1, 2, 4)
        for cp in (1, 2, 4, 8)
        if 32 % (tp * pp * cp) == 0
    ]
    given = [Strategy.parse(s) for s in SEED["strategies"]]
    out = {"setting": {k: v for k, v in SEED.items() if k != "reported"}, "reported_by_the_seed": SEED["reported"]}
    costs = strategy_costs(cfg, [*given, *candidates], SEED["buckets"])  # fitted once for both predictions
    for key, strategies in (("artifact_strategies", given), ("fastest_per_bucket", None)):
        out[key] = predict(cfg, strategies, SEED["buckets"], candidates, SEED["documents"], "commoncrawl", costs=costs)
    return out


MODEL = [
    "model=llama_tiny",
    "model.llm.dim=128",
    "model.llm.n_layers=4",
    "model.llm.n_heads=4",
    "model.llm.n_kv_heads=2",
    "model.llm.ffn_dim=352",
]


def length_scale(options: dict[str, str]) -> float:
    value = options["length_scale"]
    return int(options["max_len"]) / 32768 if value == "auto" else float(value)


def _common(options: dict[str, str], limit_gb: float) -> list[str]:
    devices, nodes = int(options["devices"]), int(options["nodes"])
    if nodes < 1 or devices % nodes:
        raise SystemExit(f"devices={devices} must split evenly over nodes={nodes}")
    return MODEL + [
        f"model.seq_len={options['max_len']}",
        "data=longtail_text",
        f"data.packing.source={options['source']}",
        f"data.packing.documents_per_step={options['documents']}",
        f"data.packing.length_scale={length_scale(options)}",
        f"trainer.devices={devices // nodes}",
        f"trainer.num_nodes={nodes}",
        f"trainer.max_steps={options['steps']}",
        "trainer.log_every_n_steps=1",
        "trainer.checkpoint.every_n_steps=0",
        "trainer.progress_bar=false",
        "cluster.runtime_overhead_gb=0",
        "parallel.recompute=full",  # every run: the limit leaves no room for pure DP even so
        f"cluster.memory_per_device_gb={limit_gb:.6f}",
        "parallel=hotspa",
    ]


def static_candidates(options: dict[str, str], cfg) -> list[str]:
    if options["static"] != "all":
        return options["static"].split(",")
    from disttrain_core.planner.hotspa_auto import candidate_strategies, runs_on

    max_len = int(options["max_len"])
    return [s.name for s in candidate_strategies(int(options["devices"])) if runs_on(cfg, s, max_len)]


def memory_limit(options: dict[str, str], extra: list[str]) -> tuple[float, float, dict[str, float]]:
    """(limit in GB, planner.memory_margin, bytes each static candidate needs at max_len): a strategy fits
    when it needs at most limit x margin; the limit sits just below what pure DP needs at least. ``extra``: the
    overrides every run gets (parallel.cp_mode=ulysses, ...), so the candidates are those the runs accept."""
    from disttrain_core.config import compose, typed_config
    from disttrain_core.parallel.switch_plan import Strategy
    from disttrain_core.planner.fit import strategy_memory

    devices, max_len = int(options["devices"]), int(options["max_len"])
    cfg = typed_config(
        compose(
            _common(options, 1000.0) + extra + [f"parallel.hotspa.strategies=[dp{devices}]", "trainer.accelerator=cpu"]
        )
    )
    least_dp = strategy_memory(cfg, Strategy(dp=devices), max_len, recompute="full", shard="zero3").memory["llm"]
    margin = float(cfg.planner.memory_margin)
    limit_gb = least_dp * 0.999 / margin / 1e9
    needs = {}
    for name in static_candidates(options, cfg):
        ev = strategy_memory(cfg, Strategy.parse(name), max_len)
        needs[name] = ev.memory.get("llm", float("inf")) if ev.feasible else float("inf")
    needs[f"dp{devices} (zero3, full recompute)"] = least_dp
    return limit_gb, margin, needs


def run(args: list[str], run_dir: Path, skip: int, options: dict[str, str]) -> dict:
    command = [sys.executable, str(REPO_ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"]
    if int(options["nodes"]) > 1:
        cluster = REPO_ROOT / "tools" / "netem_cluster.py"
        network = [f"nodes={options['nodes']}", f"rate={options['rate']}", f"delay={options['delay']}", "timeout=1500"]
        command = [sys.executable, str(cluster), *network, "--", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800, cwd=REPO_ROOT)
    if result.returncode != 0:
        raise SystemExit(f"train.py {' '.join(args)} failed:\n{result.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kept = [r for r in rows if r["step"] > skip]
    plan = run_dir / "hotspa_plan.json"  # strategies=auto: what it chose
    chosen = json.loads(plan.read_text()) if plan.is_file() else None
    return {
        **({"auto": {"buckets": chosen["buckets"], "strategies": chosen["strategies"]}} if chosen else {}),
        "tokens_per_s": statistics.median(r["perf/tokens_per_s"] for r in kept),
        "switch_fraction": statistics.median(r.get("perf/switch_fraction", 0.0) for r in kept),
        "switch_s_per_step": statistics.median(
            r.get("perf/switch_fraction", 0.0) * r["perf/step_time_s"] for r in kept
        ),
        "final_loss": rows[-1]["loss"],
    }


def main(argv: list[str]) -> int:
    options, extra = split_tool_args(argv, OPTIONS)
    results: dict = {"command": "python tools/bench_hotspa.py " + " ".join(argv)}
    if options["measure"] == "true":
        results.update(measure(options, extra))
    if options["predict"] == "true":
        results["predicted_at_scale"] = predict_at_scale()
        if options["picture"] != "none":
            from disttrain_core.planner.hotspa import draw_step

            draw_step(results["predicted_at_scale"]["artifact_strategies"], options["picture"])
    out = Path(options["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    if options["format"] == "json":
        print(json.dumps(results, indent=2))
        return 0
    if "ratio_median" in results:
        print(
            f"memory limit {results['memory_limit_gb']:.4f} GB per process; static strategies that fit: "
            f"{', '.join(results['static_that_fit'])}"
        )
        print(
            f"hotspa / best static tokens/s: median {results['ratio_median']:.3f} (min {results['ratio_min']:.3f}, "
            f"max {results['ratio_max']:.3f}) over {len(results['alternations'])} alternation(s); switching "
            f"{100 * results['switch_fraction_median']:.1f}% of hotspa's step time "
            f"({results['switch_s_per_step_median']:.3f} s per step)"
        )
        if "auto_ratio_median" in results:
            print(f"strategies=[auto] with the profile / best static: median {results['auto_ratio_median']:.3f}")
    if "predicted_at_scale" in results:
        for key, p in results["predicted_at_scale"].items():
            if key in ("artifact_strategies", "fastest_per_bucket"):
                print(
                    f"predicted, llama2_32b on 32 A800s ({key}: {', '.join(p['strategies'])}): step "
                    f"{p['hotspa_step_s']:.1f} s, {p['speedup_over_best_static']:.2f}x the best static "
                    f"({p['best_static']}), {p['speedup_over_longest_bucket_strategy']:.2f}x the longest bucket's "
                    f"strategy used statically; switching {p['switch_s_per_step']:.2f} s per step "
                    "(the seed reports up to 2.99x over Megatron-LM and switches under 1 s)"
                )
    print(f"-> {out}")
    return 0


def measure(options: dict[str, str], extra: list[str]) -> dict:
    """HotSPa against the static strategies that fit, alternated (module doc)."""
    skip = int(options["skip"])
    if int(options["steps"]) <= skip:
        raise SystemExit(f"steps={options['steps']} must exceed skip={skip}")
    limit_gb, margin, needs = memory_limit(options, extra)
    candidates = [name for name in needs if not name.endswith(")")]  # the pure-DP floor is not a candidate
    fitting = [name for name in candidates if needs[name] <= limit_gb * 1e9 * margin]
    if not fitting:
        raise SystemExit(f"no static candidate fits {limit_gb:.4f} GB ({needs}); add tp or cp candidates")
    common = _common(options, limit_gb) + extra
    auto = ["data.packing.buckets=null", "parallel.hotspa.strategies=[auto]"]
    if options["strategies"] == "auto":
        hot = common + auto
        if options["profile"] != "none":
            hot.append(f"parallel.hotspa.profile={Path(options['profile']).resolve()}")
    else:
        hot = common + [
            f"data.packing.buckets=[{options['buckets']}]",
            f"parallel.hotspa.strategies=[{options['strategies']}]",
        ]
    also_auto = None
    if options["auto_profile"] != "none":
        also_auto = common + auto + [f"parallel.hotspa.profile={Path(options['auto_profile']).resolve()}"]
    statics = {
        name: common + [f"data.packing.buckets=[{options['max_len']}]", f"parallel.hotspa.strategies=[{name}]"]
        for name in fitting
    }
    alternations = []
    with tempfile.TemporaryDirectory() as tmp:
        for a in range(int(options["alternations"])):
            entry = {"hotspa": run(hot, Path(tmp) / f"hot{a}", skip, options)}
            if also_auto is not None:
                entry["hotspa_auto"] = run(also_auto, Path(tmp) / f"auto{a}", skip, options)
            for name, args in statics.items():
                entry[name] = run(args, Path(tmp) / f"{name}{a}", skip, options)
            best = max(fitting, key=lambda n: entry[n]["tokens_per_s"])
            entry["best_static"] = best
            entry["ratio"] = entry["hotspa"]["tokens_per_s"] / entry[best]["tokens_per_s"]
            line = f"alternation {a + 1}: hotspa / {best} = {entry['ratio']:.3f}"
            if also_auto is not None:
                entry["auto_ratio"] = entry["hotspa_auto"]["tokens_per_s"] / entry[best]["tokens_per_s"]
                chosen = entry["hotspa_auto"]["auto"]
                line += f"; auto ({chosen['strategies']} for {chosen['buckets']}) / {best} = {entry['auto_ratio']:.3f}"
            alternations.append(entry)
            if options["format"] == "text":
                print(line, flush=True)
    ratios = [e["ratio"] for e in alternations]
    return {
        "model_overrides": MODEL,
        "options": options,
        "memory_limit_gb": limit_gb,
        "memory_margin": margin,
        "predicted_bytes_at_max_len": needs,
        "static_that_fit": fitting,
        "alternations": alternations,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "switch_fraction_median": statistics.median(e["hotspa"]["switch_fraction"] for e in alternations),
        "switch_s_per_step_median": statistics.median(e["hotspa"]["switch_s_per_step"] for e in alternations),
        **(
            {"auto_ratio_median": statistics.median(e["auto_ratio"] for e in alternations)}
            if also_auto is not None
            else {}
        ),
    }


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
