"""Exhaustive search and the baselines the orchestration solver is compared with (docs/PLANNER.md):
the rigid Megatron layout and the FLOPs-proportional split. Each takes the ``Orchestrator`` whose
options, model and messages it uses."""

from __future__ import annotations

import math
import time

from .evaluate import AUDIO_UNITS, COLOCATED, Evaluation, UnitChoice
from .solver import Orchestrator, Plan, PlanningError


def exhaustive(solver: Orchestrator) -> Plan:
    """Every combination of the solver's options: the reference Algorithm 1 is checked against."""
    started = time.perf_counter()
    N = solver.m.devices
    best: Evaluation | None = None
    count = 0
    for opt in solver.llm_options():
        B = solver.m.micro * opt.dp
        for pl in solver.llm_pp_options(opt.vpp, opt.dp):
            llm = opt.choice(pl)
            if llm.gpus > N:
                break
            for enc in solver.side_options("encoder", B):
                enc_choices = [enc]
                if enc is not None and not enc.colocated:
                    enc_choices = [UnitChoice(enc.tp, enc.dp, pe) for pe in solver.enc_pp_options(enc.tp)]
                for e in enc_choices:
                    used = llm.gpus + (e.gpus if e is not None else 0)
                    if used > N:
                        break
                    for gen in solver.side_options("generator", B):
                        if used + (gen.gpus if gen is not None else 0) > N:
                            continue
                        for audio in solver.audio_products(B):  # evaluate refuses what cannot run
                            count += 1
                            result = solver.m.evaluate(llm, e, gen, audio)
                            if result.feasible and (best is None or result.iteration_s < best.iteration_s):
                                best = result
    if best is None:
        raise PlanningError(solver.no_layout_reason())
    return Plan("exhaustive", best, N, time.perf_counter() - started, count)


def megatron(solver: Orchestrator, as_paper: bool = False) -> Plan | None:
    """The rigid layout: every module with the LLM's DP and TP; encoder and generator either
    folded into the first / last LLM stage (Megatron-LM's multimodal example) or one extra
    stage each. The best DP/TP/PP of both. As the runtime's megatron layout does
    (parallel/plan.py), an extra modality stage takes the LLM's CP ranks as data-parallel replicas.

    ``as_paper``: Megatron-LM as the DistTrain paper ran it (its section 2.1 and Figure 2): the encoder and the
    generator one extra stage each, the LLM's layers split evenly (unless parallel.pp_split says otherwise), no
    virtual stages and no context parallelism; the paper lists no DP/TP/PP of its own, so the best of those."""
    started = time.perf_counter()
    best = None
    count = 0
    for opt in solver.llm_options():
        if as_paper and (opt.vpp != 1 or opt.cp != 1):
            continue
        tp, side_dp = opt.tp, opt.dp * opt.cp
        for pl in solver.llm_pp_options(opt.vpp, opt.dp):
            llm = opt.choice(pl)
            for separate in (True,) if as_paper else (False, True):
                if separate and not (solver.has_enc or solver.has_gen):
                    continue
                if separate and (solver.m.micro * opt.dp) % side_dp:
                    continue  # the replicas could not split a microbatch slot's samples evenly
                side = UnitChoice(tp, side_dp, 1) if separate else COLOCATED
                enc = side if solver.has_enc else None
                gen = None
                if solver.has_gen:  # an extra stage at the same tp (its transformers split over it)
                    gen = UnitChoice(tp, side_dp, 1) if separate else COLOCATED
                count += 1
                result = solver.m.evaluate(llm, enc, gen)
                if result.feasible and (best is None or result.iteration_s < best.iteration_s):
                    best = result
    if best is None:
        return None
    name = "megatron_paper" if as_paper else "megatron"
    return Plan(name, best, solver.m.devices, time.perf_counter() - started, count)


def flops_proportional(solver: Orchestrator) -> Plan | None:
    """Devices split in proportion to each module's training FLOPs, then the best strategy
    inside each share (the "ratio-based" allocation DistTrain compares against)."""
    started = time.perf_counter()
    w, N = solver.w, solver.m.devices
    flops = {name: u.train_flops * u.items_per_sample for name, u in w.units.items()}
    for rider in AUDIO_UNITS:  # they run in the LLM unit (parallel/units.py)
        flops["llm"] += flops.pop(rider, 0.0)
    total = sum(flops.values())
    share = {name: max(1, math.floor(N * f / total)) for name, f in flops.items()}
    best = None
    count = 0
    for opt in solver.llm_options():
        B = solver.m.micro * opt.dp
        llm_fit = [p for p in solver.llm_pp_options(opt.vpp, opt.dp) if p * opt.width <= share["llm"]]
        if not llm_fit:
            continue
        llm = opt.choice(llm_fit[-1])
        enc_best = _best_side(solver, "encoder", share.get("encoder", 0), B, llm)
        gen_best = _best_side(solver, "generator", share.get("generator", 0), B, llm)
        if (solver.has_enc and enc_best is None) or (solver.has_gen and gen_best is None):
            continue
        count += 1
        result = solver.m.evaluate(llm, enc_best, gen_best)
        if result.feasible and (best is None or result.iteration_s < best.iteration_s):
            best = result
    if best is None:
        return None
    return Plan("flops_proportional", best, N, time.perf_counter() - started, count)


def _best_side(solver: Orchestrator, unit: str, devices: int, samples: int, llm: UnitChoice):
    """The fastest separate choice for ``unit`` within ``devices`` (its own stage time)."""
    if not (solver.has_enc if unit == "encoder" else solver.has_gen):
        return None
    best, best_t = None, float("inf")
    for option in solver.side_options(unit, samples):
        if option is None or option.colocated:
            continue
        for pp in solver.enc_pp_options(option.tp) if unit == "encoder" else [1]:
            choice = UnitChoice(option.tp, option.dp, pp)
            if choice.gpus > devices:
                break
            t = solver.m.stage_time(unit, choice, samples / choice.dp, solver.m.pp_bw(solver.m.devices))
            if t < best_t:
                best, best_t = choice, t
    return best
