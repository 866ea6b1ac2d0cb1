"""A plan as a table, as JSON, and as predicted pipeline timelines (PNG)."""

from __future__ import annotations

from pathlib import Path

from ..parallel.units import SIDE_UNITS, UNIT_NAMES
from .api import PlanResult
from .evaluate import Evaluation, LayoutModel
from .solver import Plan

UNITS = UNIT_NAMES  # in data-flow order (parallel/units.py)
SHORT = {"audio_encoder": "audio", "video_encoder": "video", "audio_generator": "audio gen"}  # the unit column


def model_flops_per_iteration(model: LayoutModel) -> float:
    return model.batch * sum(u.train_flops * u.items_per_sample for u in model.w.units.values())


def mfu(model: LayoutModel, evaluation: Evaluation) -> float:
    if not evaluation.feasible or evaluation.gpus == 0:
        return 0.0
    return model_flops_per_iteration(model) / (evaluation.iteration_s * evaluation.gpus * model.c.hw.peak_flops)


def binding_constraint(model: LayoutModel, plan: Plan) -> str:
    """What stops this plan from being faster, in words."""
    e = plan.evaluation
    llm = e.choices["llm"]
    stage = {}
    for name, t in e.stage_times:
        stage[name] = max(stage.get(name, 0.0), t)
    slowest = max(stage, key=stage.get)
    others = ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in stage.items() if n != slowest)
    words = [f"the {slowest} stages set the 1F1B pace ({stage[slowest] * 1e3:.1f} ms per microbatch"]
    words[0] += f"; {others})" if others else ")"
    layers = model.w.units["llm"].layers
    bigger = [p for p in range(llm.pp + 1, layers + 1) if layers % (p * llm.vpp) == 0]
    if bigger:
        extra = llm.tp * llm.cp * llm.dp * (bigger[0] - llm.pp)
        if e.gpus + extra > model.devices:
            words.append(
                f"{e.gpus} of {model.devices} devices are used: the next LLM pipeline size ({bigger[0]}, "
                f"{model.w.units['llm'].layers} layers) would need {e.gpus + extra}"
            )
    limit = model.limit
    fullest = max(e.memory, key=e.memory.get)
    share = e.memory[fullest] / limit
    if share > 0.85:
        words.append(
            f"memory binds on the {fullest} devices ({e.memory[fullest] / 1e9:.1f} of {limit / 1e9:.1f} GB usable)"
        )
    return "; ".join(words)


def unit_rows(evaluation: Evaluation) -> dict:
    rows = {}
    for name in UNITS:
        choice = evaluation.choices.get(name)
        if choice is None:
            continue
        rows[name] = choice.as_dict()
        if name in evaluation.recompute:
            rows[name]["recompute"] = evaluation.recompute[name]
        if name in evaluation.shard:
            rows[name]["shard"] = evaluation.shard[name]
        if name in evaluation.memory:
            rows[name]["memory_gb"] = round(evaluation.memory[name] / 1e9, 3)
    return rows


def plan_dict(result: PlanResult) -> dict:
    model, plan = result.model, result.plan
    e = plan.evaluation
    out = {
        **result.cfg_summary,
        "units": unit_rows(e),
        "microbatches": e.microbatches,
        # what the run trains with (planner/auto.py), chosen among planner.schedules (planner/schedule_choice.py)
        "schedule": e.schedule if len(e.stage_times) > 1 else "none",
        "pipeline_stages": len(e.stage_times),
        "gpus_used": e.gpus,
        "predicted_iteration_s": e.iteration_s,
        "samples_per_s": model.batch / e.iteration_s,
        "mfu": mfu(model, e),
        "solve_seconds": plan.solve_seconds,
        "convex_problems_solved" if plan.name == "disttrain" else "layouts_evaluated": plan.candidates,
        "binding_constraint": binding_constraint(model, plan),
        "llm_pp_split": list(e.llm_split) or None,  # parallel.pp_split: blocks per LLM stage (None: even)
        "baselines": {},
    }
    for name, base in plan.baselines.items():
        b = base.evaluation
        out["baselines"][name] = {
            "units": unit_rows(b),
            "gpus_used": b.gpus,
            "predicted_iteration_s": b.iteration_s,
            "mfu": mfu(model, b),
            "speedup_of_plan": b.iteration_s / e.iteration_s,
        }
    return out


def plan_table(result: PlanResult) -> str:
    d = plan_dict(result)
    costs = f"{d['cost_model']} costs"
    if d.get("profiled"):
        timed = ", ".join(f"{unit} tp {'/'.join(map(str, sizes))}" for unit, sizes in d["profiled"].items())
        costs = f"costs profiled for {timed}, analytic otherwise"
    lines = [
        f"plan for {d['model']} on {d['devices']} x {d['cluster']} ({d['precision']}, "
        f"global batch {d['global_batch']}, micro batch {d['micro_batch']}, {costs}, "
        f"{d['solver']} in {d['solve_seconds'] * 1e3:.0f} ms)",
        "",
        f"{'unit':10s} {'gpus':>6s} {'dp':>5s} {'tp':>3s} {'cp':>3s} {'ep':>3s} {'pp':>4s} {'vpp':>4s} {'shard':>6s} "
        f"{'recompute':>13s} {'memory/device':>14s}",
    ]
    for name, row in d["units"].items():
        if row.get("colocated"):
            lines.append(f"{SHORT.get(name, name):10s} {'colocated with the LLM (its first/last stage)':>40s}")
            continue
        mem = f"{row['memory_gb']:.1f} GB" if "memory_gb" in row else ""
        lines.append(
            f"{SHORT.get(name, name):10s} {row['gpus']:6d} {row['dp']:5d} {row['tp']:3d} {row.get('cp', 1):3d} "
            f"{row.get('ep', 1):3d} "
            f"{row['pp']:4d} {row['vpp']:4d} {row.get('shard', 'zero1'):>6s} {row.get('recompute', 'none'):>13s} "
            f"{mem:>14s}"
        )
        riding = [n for n in SIDE_UNITS if n in result.model.w.units and n not in d["units"]] if name == "llm" else []
        for rider in riding:
            where = "last" if rider == "audio_generator" else "first"
            lines.append(f"{SHORT[rider]:10s} {f'in the LLM unit (its {where} stage, its tp)':>40s}")
    lines += [
        "",
        f"schedule {d['schedule']}, {d['pipeline_stages']} pipeline stages, {d['microbatches']} microbatches; "
        f"{d['gpus_used']} of {d['devices']} devices",
        f"predicted iteration {d['predicted_iteration_s']:.3f} s ({d['samples_per_s']:.1f} samples/s), "
        f"MFU {d['mfu']:.1%}",
        f"binding: {d['binding_constraint']}",
    ]
    if d.get("llm_pp_split"):
        lines.append(f"LLM blocks per pipeline stage (parallel.pp_split): {d['llm_pp_split']}")
    if d["baselines"]:
        lines += ["", f"{'baseline':20s} {'gpus':>6s} {'iteration':>10s} {'MFU':>7s} {'plan speedup':>13s}  layout"]
        for name, b in d["baselines"].items():
            layout = ", ".join(
                f"{u} colocated" if r.get("colocated") else f"{u} {r['dp']}x{r['tp']}x{r['pp']}{_cp_ep(r)}"
                for u, r in b["units"].items()
            )
            lines.append(
                f"{name:20s} {b['gpus_used']:6d} {b['predicted_iteration_s']:9.3f}s {b['mfu']:6.1%} "
                f"{b['speedup_of_plan']:12.2f}x  {layout} (dp x tp x pp)"
            )
    return "\n".join(lines)


def _cp_ep(row: dict) -> str:
    """`` cp2 ep4`` after a dp x tp x pp triple, for the sizes above 1."""
    return "".join(f" {key}{row[key]}" for key in ("cp", "ep") if row.get(key, 1) > 1)


def predicted_timelines(result: PlanResult, path: str | Path, max_microbatches: int = 16) -> Path:
    """Simulated 1F1B timelines of the plan and its baselines from the stage times of the model (virtual LLM
    stages drawn as their pipeline stage: the picture shows the stage balance, not the interleaving)."""
    from ..schedule.generators import build_schedule
    from ..schedule.simulator import Durations, simulate
    from ..schedule.timeline import plot_timelines

    panels = []
    entries = [("plan", result.plan)] + list(result.plan.baselines.items())
    for name, plan in entries:
        e = plan.evaluation
        stages = [t for _, t in e.stage_times]
        m = min(e.microbatches, max(max_microbatches, 2 * len(stages)))  # enough to reach the steady phase
        schedule = build_schedule("1f1b" if len(stages) > 1 else "gpipe", len(stages), m)
        sim = simulate(schedule, Durations(forward=1 / 3, backward=2 / 3, per_stage=stages))
        units = " | ".join(
            f"{u} {c.dp}x{c.tp}x{c.pp}{_cp_ep(c.as_dict())}" for u, c in e.choices.items() if not c.colocated
        )
        shown = f"{m} of {e.microbatches} microbatches" if m < e.microbatches else f"{m} microbatches"
        title = f"{name}: {units} (dp x tp x pp), {shown}, {e.iteration_s:.2f} s per iteration"
        panels.append((title, sim.timeline, len(stages)))
    return plot_timelines(panels, path, ranks=1, unit="seconds", share_time_axis=True)
