"""HotSPa at scale, predicted: a bucketed step (a strategy per length bucket, hot switches between them)
against static strategies on the same documents, from the planner's cost model.

Per strategy sigma (a rigid layout over every device, evaluated by planner/evaluate.py with analytic costs),
the busiest pipeline stage's forward + backward time of one packed row is fitted as

    t_sigma(row) = a * sum_i s_i^2 + b * sum_i s_i + c        (s_i: the lengths of the row's documents)

from evaluations at three row lengths (attention inside each document, as varlen attention computes it;
the quadratic term is attention, the linear one everything else, c the per-row transfers). A group of rows
on sigma takes, on its slowest data-parallel replica (rows dealt round-robin), the sum of its rows' times
plus (pp - 1) times its longest row (pipeline fill and drain: the Hydraulis cost model the HotSPa authors
use, shared/reference/algorithms.md). A step adds the home strategy's gradient sync and optimizer time, and
for HotSPa the switches: per switch, the slowest rank's bytes over its links (parallel/switch_plan.py plans
with the cluster's nodes; parameters out of the home in the compute precision (bf16 under mixed precision),
gradients in fp32 back).

Memory: a strategy serves a bucket only if the planner's memory model holds rows of the bucket's length
(``feasible``); the static candidates must hold the longest documents.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from ..data.packing import bucket_and_pack, pack, sample_lengths
from ..parallel.switch_plan import PlanCache, Strategy, strategy_layout


@dataclass
class StrategyCost:
    strategy: Strategy
    a: float  # s per squared token (attention)
    b: float  # s per token
    c: float  # s per row
    sync_s: float  # gradient sync + optimizer of the step
    fits: dict[int, bool]  # row length -> holds it in memory

    def row(self, lengths: list[int]) -> float:
        return self.a * sum(s * s for s in lengths) + self.b * sum(lengths) + self.c

    def group(self, rows: list[list[int]]) -> float:
        """Time of ``rows`` on this strategy: the slowest replica's rows plus the pipeline fill."""
        if not rows:
            return 0.0
        dp, pp = self.strategy.dp, self.strategy.pp
        replicas = [sum(self.row(r) for r in rows[d::dp]) for d in range(dp)]
        return max(replicas) + (pp - 1) * max(self.row(r) for r in rows)


def _evaluate(cfg, strategy: Strategy, seq_len: int, memory: bool):
    from ..parallel.hotspa_layout import strategy_config
    from .api import build_layout_model, choices_of_config

    scfg = strategy_config(
        cfg,
        strategy,
        seq_len,
        extra={
            "planner": {"cost": "analytic", "recompute": cfg.parallel.recompute, "shard": "zero1"},
            "optim": {"micro_batch_size": 1, "global_batch_size": strategy.dp},
            "cluster": {} if memory else {"memory_per_device_gb": 1e9},
        },
    )
    model = build_layout_model(scfg, devices=strategy.world, progress=lambda *_: None)
    return model.evaluate(*choices_of_config(scfg))


def strategy_cost(cfg, strategy: Strategy, lengths: tuple[int, int, int], check: list[int]) -> StrategyCost:
    """Fit t(row) for ``strategy`` from dense rows of three ``lengths``; memory checked at ``check`` lengths."""
    times = []
    sync = 0.0
    for n in lengths:
        ev = _evaluate(cfg, strategy, n, memory=False)
        if not ev.stage_times:
            raise ValueError(f"strategy {strategy.name} cannot run rows of {n} tokens: {ev.reason}")
        times.append(max(t for _, t in ev.stage_times))
        sync = ev.sync_s
    a, b, c = fit_row_time(lengths, times)
    return StrategyCost(strategy, a, b, c, sync, memory_fits(cfg, strategy, check))


def fit_row_time(lengths, times) -> tuple[float, float, float]:
    """(a, b, c) of t(n) = a n^2 + b n + c through three (dense row length, time) points, each at least 0:
    a dense row of n tokens is one document of n."""
    x = torch.tensor([[float(n * n), float(n), 1.0] for n in lengths], dtype=torch.float64)
    a, b, c = torch.linalg.solve(x, torch.tensor([float(t) for t in times], dtype=torch.float64)).tolist()
    return max(a, 0.0), max(b, 0.0), max(c, 0.0)


def memory_fits(cfg, strategy: Strategy, lengths) -> dict[int, bool]:
    """Whether ``strategy`` holds rows of each length in ``cluster.memory_per_device_gb`` (planner's model)."""
    return {n: _evaluate(cfg, strategy, n, memory=True).feasible for n in lengths}


def switch_seconds(plans: PlanCache, source: str, target: str, hw, per_node: int, bytes_per_element: int) -> float:
    """The slowest rank's time to send and receive its part of a switch over its links."""
    plan = plans.get(source, target)
    load: dict[int, list[float]] = {}
    for (sender, receiver), transfers in plan.messages.items():
        numel = sum(t.numel for t in transfers) * bytes_per_element
        bw = hw.intra_bw if sender // per_node == receiver // per_node else hw.inter_bw
        for rank in (sender, receiver):
            load.setdefault(rank, [0.0])[0] += numel / bw
    return max((v[0] for v in load.values()), default=0.0) + (hw.latency_s if plan.messages else 0.0)


def sampled_batches(source: str, documents: int, longest: int, seed: int, steps: int, scale: float = 1.0):
    """``steps`` global batches of document lengths, as data/packed_loader.py draws them for ``seed``."""
    out = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        out.append(sample_lengths(source, documents, longest, generator, scale=scale))
    return out


def fit_lengths(longest: int) -> tuple[int, int, int]:
    """The three row lengths t(row) is fitted at for buckets up to ``longest``."""
    return (max(longest // 8, 16), max(longest // 2, 32), longest)


def predict(
    cfg,
    strategies: list[Strategy] | None,
    buckets: list[int],
    candidates: list[Strategy],
    documents: int,
    source: str,
    seed: int = 0,
    steps: int = 4,
    scale: float = 1.0,
    costs: dict[str, StrategyCost] | None = None,
    batches: list[list[int]] | None = None,
) -> dict:
    """Predicted step times of HotSPa (``strategies`` per ``buckets``; None: per bucket the fastest candidate
    that holds it), of every static candidate that holds the longest bucket, and of the longest bucket's
    strategy used statically, averaged over ``steps`` sampled global batches of ``documents`` documents
    (lengths of ``source`` x ``scale``; ``batches``: given document lengths instead). ``costs``: fitted
    already (every strategy named, fits at every bucket)."""
    longest = buckets[-1]
    if costs is None:
        costs = strategy_costs(cfg, [*(strategies or []), *candidates], buckets)
    if batches is None:
        batches = sampled_batches(source, documents, longest, seed, steps, scale)
    samples = [(lengths, bucket_and_pack(lengths, buckets)) for lengths in batches]
    if strategies is None:  # per bucket, the candidate that holds it and runs its rows fastest (switches aside)
        strategies = _fastest_strategies(buckets, candidates, costs, samples)
    for s, edge in zip(strategies, buckets, strict=True):
        if not costs[s.name].fits.get(edge, False):
            raise ValueError(f"strategy {s.name} cannot hold rows of {edge} tokens in memory")
    static = [s.name for s in candidates if costs[s.name].fits[longest]]
    home, switches = _switch_costs(cfg, strategies)
    switch = sum(out + back for out, back in switches.values())
    hot_steps, static_steps, bucket_s = _step_times(samples, strategies, buckets, costs, static, home, switch, longest)
    return _summary(strategies, buckets, costs, home, switch, switches, hot_steps, static_steps, bucket_s)


def strategy_costs(cfg, strategies: list[Strategy], buckets: list[int]) -> dict[str, StrategyCost]:
    """``predict``'s ``costs``: each strategy's fitted row time and whether it holds each bucket (fitted once for
    several predictions over the same strategies and buckets)."""
    every = {s.name: s for s in strategies}
    return {name: strategy_cost(cfg, s, fit_lengths(buckets[-1]), sorted(set(buckets))) for name, s in every.items()}


def _fastest_strategies(buckets: list[int], candidates: list[Strategy], costs: dict, samples: list) -> list[Strategy]:
    """Per bucket, the candidate that holds it and runs its rows fastest (switches aside)."""
    strategies = []
    for k, edge in enumerate(buckets):
        fitting = [s for s in candidates if costs[s.name].fits[edge]]
        if not fitting:
            raise ValueError(f"no candidate strategy holds rows of {edge} tokens in memory")

        def mean_time(s, k=k):
            return statistics.mean(
                costs[s.name].group([[lengths[i] for i in row] for row in groups[k].rows])
                for lengths, groups in samples
            )

        strategies.append(min(fitting, key=mean_time))
    return strategies


def _switch_costs(cfg, strategies: list[Strategy]) -> tuple[str, dict[str, tuple[float, float]]]:
    """The home strategy and, per non-home strategy, its switch seconds (parameters out in the compute
    precision, gradients back in fp32)."""
    from ..parallel.hotspa_layout import least_state, llm_param_specs
    from .costs import Hardware, planned_precision

    precision = planned_precision(cfg)
    hw = Hardware.from_config(cfg.cluster, precision, None, tf32=bool(cfg.trainer.tf32))
    param_bytes = 2 if precision == "bf16-mixed" else 4
    per_node = int(cfg.cluster.gpus_per_node)
    specs = llm_param_specs(cfg)
    layers = int(cfg.model.llm.n_layers)
    layouts = {s.name: strategy_layout(specs, s, layers) for s in strategies}
    plans = PlanCache({n: p.shape for n, p in specs.items()}, layouts, lambda r: r // per_node)
    home = least_state(strategies, specs, layers)
    switches = {  # (parameters out in the compute precision, gradients back in fp32) per non-home strategy
        s.name: (
            switch_seconds(plans, home, s.name, hw, per_node, param_bytes),
            switch_seconds(plans, s.name, home, hw, per_node, 4),
        )
        for s in strategies
        if s.name != home
    }
    return home, switches


def _step_times(samples, strategies, buckets, costs, static, home, switch, longest):
    """Per sampled batch: HotSPa's step time, each static candidate's, and (per bucket) its compute time."""
    hot_steps, static_steps, bucket_s = [], {name: [] for name in static}, [[] for _ in buckets]
    for lengths, groups in samples:
        for k, (s, g) in enumerate(zip(strategies, groups, strict=True)):
            bucket_s[k].append(costs[s.name].group([[lengths[i] for i in row] for row in g.rows]))
        compute = sum(times[-1] for times in bucket_s)
        hot_steps.append(compute + costs[home].sync_s + switch)
        rows = [[lengths[i] for i in row] for row in pack(list(range(len(lengths))), lengths, longest)]
        for name in static:
            static_steps[name].append(costs[name].group(rows) + costs[name].sync_s)
    return hot_steps, static_steps, bucket_s


def _summary(strategies, buckets, costs, home, switch, switches, hot_steps, static_steps, bucket_s) -> dict:
    """The prediction's means and speedups, as ``predict`` returns them."""
    hot = statistics.mean(hot_steps)
    static_mean = {name: statistics.mean(v) for name, v in static_steps.items()}
    best = min(static_mean, key=static_mean.get) if static_mean else None
    megatron = strategies[-1].name
    megatron_mean = static_mean.get(megatron)
    return {
        "strategies": [s.name for s in strategies],
        "buckets": buckets,
        "home": home,
        "hotspa_step_s": hot,
        "switch_s_per_step": switch,
        "switch_s": {name: {"params_out": out, "grads_back": back} for name, (out, back) in switches.items()},
        "bucket_s": [statistics.mean(times) for times in bucket_s],
        "home_sync_s": costs[home].sync_s,
        "static_step_s": static_mean,
        "best_static": best,
        "speedup_over_best_static": static_mean[best] / hot if best else None,
        "longest_bucket_strategy_static": megatron,
        "speedup_over_longest_bucket_strategy": megatron_mean / hot if megatron_mean else None,
        "fits": {name: c.fits for name, c in costs.items()},
        "fit": {name: {"a": c.a, "b": c.b, "c": c.c} for name, c in costs.items()},
    }


def draw_step(prediction: dict, path) -> None:
    """One predicted HotSPa step as a time line: each bucket's compute, the switches around it, the sync."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    segments = []  # (label, seconds, colour)
    home = prediction["home"]
    order = [k for k, name in enumerate(prediction["strategies"]) if name != home]
    order += [k for k, name in enumerate(prediction["strategies"]) if name == home]
    for k in order:
        name, edge = prediction["strategies"][k], prediction["buckets"][k]
        switch = prediction["switch_s"].get(name)
        if switch:
            segments.append((f"switch -> {name}", switch["params_out"], "tab:red"))
        segments.append((f"<= {edge}: {name}", prediction["bucket_s"][k], "tab:blue"))
        if switch:
            segments.append((f"grads -> {home}", switch["grads_back"], "tab:orange"))
    segments.append(("sync + optimizer", prediction["home_sync_s"], "tab:green"))
    fig, ax = plt.subplots(figsize=(10, 2.2))
    start = 0.0
    for label, seconds, colour in segments:
        ax.barh(0, seconds, left=start, color=colour, edgecolor="black", linewidth=0.5)
        if seconds > 0.04 * prediction["hotspa_step_s"]:
            ax.text(start + seconds / 2, 0, label, ha="center", va="center", fontsize=7, color="white")
        start += seconds
    ax.set_yticks([])
    ax.set_xlabel("seconds (predicted)")
    switched = prediction["switch_s_per_step"]
    ax.set_title(
        f"HotSPa step, predicted: {start:.1f} s, of which switching {switched:.2f} s (red: parameters out, "
        "orange: gradients home)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
