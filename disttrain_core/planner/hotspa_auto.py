"""``parallel.hotspa.strategies=[auto]``: buckets and a strategy per bucket chosen before launch from the
planner's cost model (planner/hotspa.py) and the memory limit ``cluster.memory_per_device_gb``.

Candidates: every (dp, tp, pp, cp) whose product is the run's process count and that the runtime accepts
for the bucket (validation/layout.py: heads divisible by tp, layers by pp, rows by cp, tp inside a node,
...). Per candidate, t(row) = a sum s^2 + b sum s + c is fitted once from three row lengths, and whether it
holds rows of each candidate bucket length in memory is read from the planner's memory model.

Buckets: ``data.packing.buckets`` when given; when null, every ascending set of at most ``max_buckets``
powers of two between ``model.seq_len / 64`` (at least 16) and ``model.seq_len``, ending at
``model.seq_len``. For each set, each bucket takes the fitting candidate that runs its rows fastest over
``steps`` sampled global batches (the run's own ``data.packing`` source, documents per step, length scale
and seed; a corpus: its first ``steps`` steps); a set's predicted step adds the home strategy's sync and
every switch (planner/hotspa.py ``predict``). Every candidate that holds the longest rows is an option too,
as one static bucket. The option with the shortest predicted step wins; ties go to fewer buckets.

Beyond HotSPa, whose strategies are hand-picked. The choice and every set's prediction are printed and
saved as ``hotspa_plan.json`` in the run directory.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from omegaconf import OmegaConf

from ..parallel.switch_plan import Strategy
from ..validation import ConfigError
from .hotspa import StrategyCost, fit_lengths, memory_fits, predict, strategy_cost

AUTO = "auto"


def is_auto(cfg) -> bool:
    return list(cfg.parallel.hotspa.strategies) == [AUTO]


def candidate_strategies(world: int) -> list[Strategy]:
    """Every (dp, tp, pp, cp) over ``world`` processes, in a fixed order."""
    out = []
    for tp, pp, cp in itertools.product(_divisors(world), repeat=3):
        if world % (tp * pp * cp) == 0:
            out.append(Strategy(dp=world // (tp * pp * cp), tp=tp, pp=pp, cp=cp))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def bucket_sets(seq_len: int, max_buckets: int) -> list[list[int]]:
    """Ascending power-of-two boundaries ending at ``seq_len``, at most ``max_buckets`` of them."""
    low = max(16, seq_len // 64)
    edges = []
    edge = 1
    while edge < seq_len:
        if edge >= low:
            edges.append(edge)
        edge *= 2
    sets = []
    for k in range(max_buckets):
        for chosen in itertools.combinations(edges, k):
            sets.append([*chosen, seq_len])
    return sets


def runs_on(cfg, strategy: Strategy, capacity: int) -> bool:
    """The runtime accepts ``strategy`` for rows of ``capacity`` tokens (the checks of parallel=hotspa)."""
    from ..parallel.hotspa_layout import strategy_config
    from ..parallel.plan import units_of
    from ..validation.layout import check_layout, validate_layout_settings

    scfg = strategy_config(cfg, strategy, capacity)
    try:
        validate_layout_settings(scfg)
        check_layout(scfg, units_of(scfg))  # a candidate's layout: the planner's to resolve
    except (ConfigError, ValueError):
        return False
    return True


def _with_peak(cfg):
    """On a CPU with no peak FLOP/s in the cluster, the measured one (cached), as the planner does."""
    if cfg.cluster.device != "cpu":
        return cfg
    import torch

    from ..train.perf import peak_flops_per_device
    from .costs import planned_precision

    peak = peak_flops_per_device(
        planned_precision(cfg), torch.device("cpu"), cfg.cluster.peak_flops_bf16, cfg.cluster.peak_flops_fp32
    )
    c = cfg.cluster
    return OmegaConf.merge(
        cfg, {"cluster": {"peak_flops_bf16": c.peak_flops_bf16 or peak, "peak_flops_fp32": c.peak_flops_fp32 or peak}}
    )


def choose(cfg, max_buckets: int = 3, steps: int = 4) -> dict:
    """The buckets and strategies ``parallel.hotspa.strategies=[auto]`` runs, with every set's prediction."""
    cfg = _with_peak(cfg)
    world = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    seq_len = int(cfg.model.seq_len)
    packing = cfg.data.packing
    sets = [[int(b) for b in packing.buckets]] if packing.buckets else bucket_sets(seq_len, max_buckets)
    lengths = sorted({b for bucket in sets for b in bucket})
    candidates = [s for s in candidate_strategies(world) if any(runs_on(cfg, s, n) for n in lengths)]
    if not candidates:
        raise ConfigError(f"parallel.hotspa.strategies=[auto]: no (dp, tp, pp, cp) over {world} processes runs")
    measured = read_profile(cfg, world) if cfg.parallel.hotspa.profile else None
    costs = {}
    for s in candidates:
        if measured is not None:  # t(row) measured on this machine by tools/profile_hotspa.py
            if s.name not in measured:
                continue
            m = measured[s.name]
            cost = StrategyCost(s, m["a"], m["b"], m["c"], m["sync_s"], memory_fits(cfg, s, lengths))
        else:
            try:
                cost = strategy_cost(cfg, s, fit_lengths(seq_len), lengths)
            except ValueError:  # the planner cannot run rows of some fit length on it
                continue
        cost.fits = {n: ok and runs_on(cfg, s, n) for n, ok in cost.fits.items()}
        costs[s.name] = cost
    fitting = [s for s in candidates if s.name in costs]
    if not fitting and measured is not None:
        raise ConfigError(
            f"parallel.hotspa.profile={cfg.parallel.hotspa.profile}: it measured none of the strategies this run "
            "can use; profile them (python tools/profile_hotspa.py)"
        )
    if not fitting:
        raise ConfigError(
            f"parallel.hotspa.strategies=[auto]: the planner cannot cost any strategy over {world} processes"
        )
    # the run's own documents: its first steps, as its loader draws them (synthetic, dense or a corpus)
    from ..data.packed_loader import packed_loader

    loader = packed_loader(cfg, None)
    batches = [[d.numel() for d in loader.step_documents(k)] for k in range(steps)]

    def predicted(strategies, buckets) -> dict:
        return predict(
            cfg,
            strategies,
            buckets,
            fitting,
            int(packing.documents_per_step),
            packing.source,
            seed=int(cfg.trainer.seed),
            steps=steps,
            scale=float(packing.length_scale),
            costs=costs,
            batches=batches,
        )

    options = []
    for buckets in sets:
        if all(any(costs[s.name].fits[b] for s in fitting) for b in buckets):
            options.append(predicted(None, buckets))  # the fastest fitting candidate per bucket
    last = sets[0][-1]
    options += [predicted([s], [last]) for s in fitting if costs[s.name].fits[last]]  # every static strategy
    if not options:
        raise ConfigError(
            f"parallel.hotspa.strategies=[auto]: no strategy over {world} processes holds rows of {seq_len} tokens "
            f"within cluster.memory_per_device_gb={cfg.cluster.memory_per_device_gb:g}: raise the limit, add "
            "processes or shorten model.seq_len"
        )
    best = min(options, key=lambda p: (round(p["hotspa_step_s"], 12), len(p["buckets"])))
    return {"buckets": best["buckets"], "strategies": best["strategies"], "chosen": best, "options": options}


PROFILE_FORMAT = 1


def profile_identity(cfg, world: int) -> dict:
    """What a profile must have been measured with to serve this run: the model's shape (its context aside),
    precision, recompute, processes and nodes, and this machine's CPU or GPU model."""
    import torch

    from ..config import training_precision
    from ..train.perf import _cpu_model
    from ..validation.common import resolve_accelerator

    model = OmegaConf.to_container(cfg.model, resolve=True)
    model.pop("seq_len", None)
    device = resolve_accelerator(cfg.trainer.accelerator)
    name = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else _cpu_model()
    return {
        "model": model,
        "precision": training_precision(cfg.trainer.precision, device),
        "recompute": str(cfg.parallel.recompute),
        "world": world,
        "nodes": int(cfg.trainer.num_nodes),
        "device": name,
    }


def read_profile(cfg, world: int) -> dict[str, dict]:
    """Strategy name -> measured {a, b, c, sync_s} from ``parallel.hotspa.profile``; a profile of another
    model, precision, recompute, process count or machine is refused in one line."""
    path = Path(str(cfg.parallel.hotspa.profile))
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"parallel.hotspa.profile={path}: cannot be read ({error}); write one with python tools/profile_hotspa.py"
        ) from None
    if not isinstance(raw, dict) or raw.get("format") != PROFILE_FORMAT or not isinstance(raw.get("strategies"), dict):
        raise ConfigError(f"parallel.hotspa.profile={path}: not a profile of tools/profile_hotspa.py")
    want = profile_identity(cfg, world)
    differs = [key for key, value in want.items() if raw.get("identity", {}).get(key) != value]
    if differs:
        raise ConfigError(
            f"parallel.hotspa.profile={path} was measured with another {', '.join(differs)} than this run; "
            "profile this setting (python tools/profile_hotspa.py with the run's overrides)"
        )
    out = {}
    for name, entry in raw["strategies"].items():
        try:
            out[Strategy.parse(name).name] = {k: float(entry[k]) for k in ("a", "b", "c", "sync_s")}
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"parallel.hotspa.profile={path}: the entry of {name!r} is damaged") from None
    return out


def resolve_hotspa_auto(cfg, container: dict, run_dir: Path) -> dict:
    """``container`` with the chosen buckets and strategies (printed, and saved as hotspa_plan.json)."""
    result = choose(cfg)
    result["profile"] = cfg.parallel.hotspa.profile
    chosen = result["chosen"]
    best = chosen["best_static"]
    versus = f"{chosen['static_step_s'][best]:.3g} s for the best static strategy ({best})" if best else "no static"
    print(
        f"hotspa auto: buckets {result['buckets']} -> strategies {result['strategies']} (home {chosen['home']}); "
        f"predicted step {chosen['hotspa_step_s']:.3g} s vs {versus}; {len(result['options'])} bucket sets compared",
        flush=True,
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "hotspa_plan.json").write_text(json.dumps(result, indent=1) + "\n")
    out = {**container}
    out["data"] = {**out["data"], "packing": {**out["data"]["packing"], "buckets": list(result["buckets"])}}
    # the profile has served (hotspa_plan.json names it); the resolved config names strategies, not auto
    hotspa = {**out["parallel"]["hotspa"], "strategies": list(result["strategies"]), "profile": None}
    out["parallel"] = {**out["parallel"], "hotspa": hotspa}
    return out
