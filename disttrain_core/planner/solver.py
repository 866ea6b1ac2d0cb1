"""DistTrain's disaggregated model orchestration (Algorithm 1), its baselines and a brute-force check.

Algorithm 1. Enumerate the LLM's TP size (1, 2, 4, 8 up to the node size), its DP size
(divisors of the microbatch count), and for the encoder and the generator either
colocation or a TP size and a DP size dividing the samples of a microbatch slot (the generator also a
pipeline size of 1, 2 or 4 U-Net segment runs). For every combination the devices per unit ``(x, y)``
(the generator's are fixed by its TP, DP and PP) are continuous variables of a convex problem: with
``K = C(tp) * tp * dp`` (a whole module's time on one device group for one microbatch),
a stage time is ``K / devices + p2p``, and

    minimize   sum of stage times + (m - 1) t
    subject to t >= K_e / x + p_e,   t >= K_l / y + p_l + colocated work,   t >= T_g,
               x + y <= N - z,   bounds from TP x DP, the layer counts and memory,

convex because ``1/x`` is convex for ``x > 0``; it reduces to a convex problem in the
steady-phase stage time alone, which scipy solves (``_relax``). The
continuous optimum is rounded to pipeline sizes that divide the layer counts (the
nearest ones below and above, and the largest that fits the remaining devices), each
candidate is evaluated exactly (planner/evaluate.py), and the best feasible one is kept.

Combinations are visited in increasing order of a lower bound on their iteration time
(warm-up with every unit on one stage, steady phase with perfectly balanced stages on all
``N`` devices); once the bound reaches the best time found, the rest cannot win and are
skipped. That makes the search exact with respect to its own rounding while solving only
a small fraction of the convex problems.

The LLM's options also carry context parallelism ``cp`` and expert parallelism ``ep`` (which sizes:
planner/options.py): its devices per stage are then ``tp x cp x dp`` and ``K = C(tp, cp, ep) * tp * cp * dp``,
with ``C`` a rank's time (planner/costs.py ``rank_compute``).

``solver=exhaustive`` evaluates every integer layout with the same model, for checking
on small clusters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from scipy.optimize import brentq, minimize_scalar

from .costs import PlanningError
from .evaluate import COLOCATED, Evaluation, LayoutModel, UnitChoice
from .infeasible import no_layout_reason
from .options import CP_MIN_TOKENS, CP_OPTIONS, LlmOption, cp_candidates, divisors, ep_candidates

TP_OPTIONS = (1, 2, 4, 8)


@dataclass
class Plan:
    name: str
    evaluation: Evaluation
    devices: int
    solve_seconds: float = 0.0
    candidates: int = 0  # convex problems solved (or layouts evaluated)
    baselines: dict[str, Plan] = field(default_factory=dict)


class Orchestrator:
    def __init__(
        self,
        model: LayoutModel,
        tp_options=TP_OPTIONS,
        vpp_options=(1,),
        allow_colocation: bool = True,
        cp_options=CP_OPTIONS,
        min_cp_tokens: int = CP_MIN_TOKENS,
        allow_ep: bool = True,
    ):
        self.m = model
        c, w = model.c, model.w
        self.w = w
        per_node = c.hw.per_node
        self.tp_options = [t for t in tp_options if t <= per_node]
        self.vpp_options = tuple(vpp_options)
        self.allow_colocation = allow_colocation
        self.has_enc = w.get("encoder") is not None
        self.has_gen = w.get("generator") is not None
        self.cp_options = cp_candidates(w.seq_len, cp_options, min_cp_tokens)  # planner/options.py
        self.allow_ep = allow_ep

    # ------------------------------------------------------------------ enumeration
    def tp_ok(self, unit: str, tp: int) -> bool:
        return self.w.units[unit].tp_allowed(tp)

    def llm_pp_options(self, vpp: int, dp: int = 1) -> list[int]:
        """Pipeline sizes of the LLM: divisors of its blocks into pp x vpp stages. Virtual stages (vpp > 1) need
        pp >= 2 and, as the runtime's interleaved 1F1B does, a microbatch count (at ``dp`` replicas) that is a
        multiple of pp."""
        layers = self.w.units["llm"].layers
        m = self.m.batch // (self.m.micro * dp)
        return [
            p for p in divisors(layers) if layers % (p * vpp) == 0 and (vpp == 1 or (p > 1 and m % p == 0 and m >= p))
        ]

    def enc_pp_options(self) -> list[int]:
        return divisors(self.w.units["encoder"].layers) if self.has_enc else [1]

    def gen_pp_options(self) -> list[int]:
        """The generator's stages: 1, 2 or 4, at most its U-Net segments (parallel/generator_stages.py)."""
        segments = len(self.w.units["generator"].cut_floats) + 1 if self.has_gen else 1
        return [p for p in (1, 2, 4) if p <= segments]

    def ep_options(self, dp: int) -> tuple[int, ...]:
        """Expert-parallel sizes of a MoE LLM with ``dp`` replicas: divisors of the expert count and of dp."""
        return ep_candidates(self.w.units["llm"].num_experts if self.allow_ep else 0, dp)

    def llm_options(self):
        """LlmOptions of the LLM: dp divides the number of micro-batches; cp and ep: planner/options.py."""
        per_rank = self.m.batch // self.m.micro
        for tp in self.tp_options:
            if not self.tp_ok("llm", tp):
                continue
            for cp in self.cp_options:
                for dp in divisors(per_rank):
                    if tp * cp * dp > self.m.devices:
                        break
                    for ep in self.ep_options(dp):
                        for vpp in self.vpp_options:
                            yield LlmOption(tp, dp, vpp, cp, ep)

    def side_options(self, unit: str, samples: int) -> list[UnitChoice]:
        """Colocated, or (tp, dp) with dp dividing the samples of a microbatch slot."""
        present = self.has_enc if unit == "encoder" else self.has_gen
        if not present:
            return [None]
        options = [COLOCATED] if self.allow_colocation else []
        pps = self.gen_pp_options() if unit == "generator" else [1]  # the encoder's pp: enc_pp_min and _round
        for tp in self.tp_options:
            if not self.tp_ok(unit, tp):
                continue
            for dp in divisors(samples):
                for pp in pps:
                    if tp * dp * pp <= self.m.devices:
                        options.append(UnitChoice(tp=tp, dp=dp, pp=pp))
        return options

    # ------------------------------------------------------------------ memory bounds
    def _fits(self, used: float) -> bool:
        return used + self.m.c.hw.overhead_bytes <= self.m.limit

    def llm_pp_min(self, opt: LlmOption, m: int) -> int | None:
        """Smallest LLM pipeline size whose stages can fit (a lower bound: other units only add)."""
        c, micro = self.m.c, self.m.micro
        act = c.activation_bytes("llm", opt.tp, micro, None, opt.cp)
        logits = self.m.logits(micro, opt.cp, opt.tp)
        for pp in self.llm_pp_options(opt.vpp, opt.dp):
            # the first stage keeps min(pp, m) microbatches in flight and the embeddings, the last one the
            # head and the logits; the state is the least any shard mode holds (gradients left out: FSDP2's
            # may be absent at the peak), so this stays a bound
            first = act / pp * min(pp, m) + self._least_state(opt, pp, 0)
            last = act / pp + logits + self._least_state(opt, pp, pp - 1)
            held = first + logits if pp == 1 else max(first, last)
            if self._fits(held):
                return pp
        return None

    def _least_state(self, opt: LlmOption, pp: int, stage: int) -> float:
        state = self.m.c.state("llm", opt.tp, opt.dp, pp, None, stage, 1, opt.cp, opt.ep)
        return state.total - state.grads

    def enc_pp_min(self, enc: UnitChoice, samples: float, m: int, later_stages: int) -> int | None:
        c = self.m.c
        act = c.activation_bytes("encoder", enc.tp, self.m.images(samples))
        for pp in self.enc_pp_options():
            if self._fits(c.state_bytes("encoder", enc.tp, enc.dp, pp) + act / pp * min(pp + later_stages, m)):
                return pp
        return None

    def gen_fits(self, gen: UnitChoice, samples: float) -> bool:
        """A lower bound: the generator's average stage with its share of one microbatch's activations."""
        c = self.m.c
        act = c.activation_bytes("generator", 1, samples) / gen.pp
        return self._fits(c.state_bytes("generator", gen.tp, gen.dp, gen.pp) + act)

    # --------------------------------------------------------------------- Algorithm 1
    def combinations(self):
        """Every (LLM tp/dp/vpp, encoder option, generator option) with its bounds and a lower bound."""
        N, mdl = self.m.devices, self.m
        fastest = max(mdl.c.hw.intra_bw, mdl.c.hw.inter_bw)  # a bound must not assume the slower link
        for opt in self.llm_options():
            tp, dp, vpp, cp, ep = opt.tp, opt.dp, opt.vpp, opt.cp, opt.ep
            B = mdl.micro * dp
            m = mdl.batch // B
            a_l = opt.width
            pl_min = self.llm_pp_min(opt, m)
            if pl_min is None:
                continue
            C_l = mdl.c.rank_compute("llm", tp, mdl.micro, cp, ep)
            K_l = C_l * a_l
            p2p_l = mdl.c.p2p_s(mdl.llm_boundary_bytes(mdl.micro, cp), fastest)
            tails = {
                # zero1's traffic: the least of every shard mode (FSDP2 moves it per microbatch)
                pp: mdl.c.sync_s("llm", tp, dp, pp, "zero1", 1, cp, ep) + mdl.c.optimizer_s("llm", tp, dp, pp, cp, ep)
                for pp in self.llm_pp_options(vpp, dp)
            }
            gens = []
            for gen in self.side_options("generator", B):
                if gen is None:
                    gens.append((gen, 0.0, 0.0, 0, 0.0))
                elif gen.colocated:
                    gens.append((gen, mdl.colocated_time("generator", tp, mdl.micro), 0.0, 0, 0.0))
                elif self.gen_fits(gen, B / gen.dp):
                    # (its stage time in the steady phase, its whole time in the fill)
                    whole = mdl.c.compute("generator", gen.tp, B / gen.dp)
                    gens.append((gen, 0.0, whole / gen.pp, gen.gpus, whole))
            for enc in self.side_options("encoder", B):
                x_e = C_e = 0.0
                a_e = pe_min = 0
                if enc is not None and enc.colocated:
                    x_e = mdl.colocated_time("encoder", tp, mdl.micro)
                elif enc is not None:
                    pe_min = self.enc_pp_min(enc, B / enc.dp, m, pl_min)
                    if pe_min is None:
                        continue
                    a_e = enc.tp * enc.dp
                    C_e = mdl.c.compute("encoder", enc.tp, mdl.images(B / enc.dp))
                for gen, x_g, t_g, g_gpus, fill_g in gens:
                    budget = N - g_gpus
                    x_min = a_e * pe_min
                    y_fit = [p for p in self.llm_pp_options(vpp, dp) if pl_min <= p and a_l * p <= budget - x_min]
                    if not y_fit:
                        continue
                    y_max = a_l * y_fit[-1]
                    if a_e:
                        e_fit = [p for p in self.enc_pp_options() if p >= pe_min and a_e * p <= budget - a_l * pl_min]
                        if not e_fit:
                            continue
                        x_max = a_e * e_fit[-1]
                    else:
                        x_max = 0
                    K_e = C_e * a_e
                    p2p = p2p_l if pl_min > 1 else 0.0
                    steady = max(
                        t_g,
                        K_l / y_max + p2p + max(x_e, x_g),
                        K_e / x_max if x_max else 0.0,
                        (K_e + K_l) / budget,
                    )
                    # the LLM's ZeRO-1 traffic and optimizer step shrink as its pipeline grows
                    tail = tails[y_fit[-1]]
                    lower = C_e + (C_l + pl_min * p2p) / vpp + x_e + x_g + fill_g + (m - 1) * steady + tail
                    bounds = ((x_min, x_max), (a_l * pl_min, y_max))
                    yield lower, opt, enc, gen, bounds

    def solve(self) -> Plan:
        started = time.perf_counter()
        N = self.m.devices
        combos = sorted(self.combinations(), key=lambda item: item[0])
        if not combos:
            raise PlanningError(self.no_layout_reason())
        best: Evaluation | None = None
        solved = 0
        for lower, opt, enc, gen, bounds in combos:
            if best is not None and lower >= best.iteration_s * (1 - 1e-9):
                break
            solved += 1
            relaxed = self._relax(opt, enc, gen, bounds)
            for candidate in self._round(relaxed, opt, enc, gen):
                if candidate.feasible and (best is None or candidate.iteration_s < best.iteration_s):
                    best = candidate
        if best is None:
            raise PlanningError(self.no_layout_reason())
        return Plan("disttrain", best, N, time.perf_counter() - started, solved)

    def _relax(self, opt: LlmOption, enc, gen, bounds) -> tuple[float, float]:
        """Continuous optimum (encoder devices x, LLM devices y) of one combination.

        The convex problem in (x, y, t) reduces to one dimension: for a steady-phase stage time
        ``t`` the fewest devices that achieve it are ``x(t) = max(x_lo, K_e / (t - c_e))`` and
        ``y(t) = max(y_lo, K_l / (t - c_l))`` (convex, decreasing), so the objective
        ``(m - 1) t + w_x x(t) + w_y y(t)`` is convex in ``t`` on the interval where the bounds
        and the budget ``x(t) + y(t) <= D`` hold. scipy finds the interval's end with ``brentq``
        and the minimum with a bounded ``minimize_scalar``.
        """
        mdl, c = self.m, self.m.c
        tp, vpp = opt.tp, opt.vpp
        B = mdl.micro * opt.dp
        m = mdl.batch // B
        bw = mdl.pp_bw(mdl.devices)
        sep_enc = enc is not None and not enc.colocated
        g_gpus = gen.gpus if gen is not None and not gen.colocated else 0
        t_g = c.compute("generator", gen.tp, B / gen.dp) / gen.pp if g_gpus else 0.0
        x_e = mdl.colocated_time("encoder", tp, mdl.micro) if enc is not None and enc.colocated else 0.0
        x_g = mdl.colocated_time("generator", tp, mdl.micro) if gen is not None and gen.colocated else 0.0
        a_l = opt.width
        K_l = c.rank_compute("llm", tp, mdl.micro, opt.cp, opt.ep) * a_l
        p_l = c.p2p_s(mdl.llm_boundary_bytes(mdl.micro, opt.cp), bw)
        c_l = p_l + x_e + x_g
        if sep_enc:
            a_e = enc.tp * enc.dp
            K_e = c.compute("encoder", enc.tp, mdl.images(B / enc.dp)) * a_e
            c_e = c.p2p_s(c.boundary_bytes("encoder", B / enc.dp), bw)
        else:
            a_e, K_e, c_e = 1, 0.0, 0.0
        D = float(mdl.devices - g_gpus)
        (x_lo, x_hi), (y_lo, y_hi) = bounds
        if not sep_enc:
            x_lo = x_hi = 0.0
        if x_lo + y_lo > D:
            return x_lo, y_lo

        # Devices a stage time t needs; t_lo sits at the upper bounds, where t - c can round to 0 when c
        # dwarfs the compute term (extreme workloads): the bound it was chosen for, not a division by zero.
        def x_of(t: float) -> float:
            if not sep_enc:
                return 0.0
            return max(x_lo, min(x_hi, K_e / (t - c_e))) if t > c_e else x_hi

        def y_of(t: float) -> float:
            return max(y_lo, min(y_hi, K_l / (t - c_l))) if t > c_l else y_hi

        def objective(t: float) -> float:
            return (m - 1) * t + c_e / a_e * x_of(t) + p_l / (a_l * vpp) * y_of(t)

        t_lo = max(t_g, c_l + K_l / y_hi, (c_e + K_e / x_hi) if sep_enc else 0.0)
        t_hi = max(t_g, c_l + K_l / y_lo, (c_e + K_e / x_lo) if sep_enc else 0.0)
        if x_of(t_lo) + y_of(t_lo) > D:  # the budget binds: the smallest t whose devices fit
            if x_of(t_hi) + y_of(t_hi) >= D:  # only the lower bounds fit (up to rounding)
                return x_of(t_hi), y_of(t_hi)
            t_lo = brentq(lambda t: x_of(t) + y_of(t) - D, t_lo, t_hi, xtol=1e-12 * max(t_hi, 1e-12))
        if t_hi - t_lo > 1e-12 * t_hi and (c_e > 0 or p_l > 0):
            t = minimize_scalar(objective, bounds=(t_lo, t_hi), method="bounded").x
            t = t if objective(t) < objective(t_lo) else t_lo
        else:
            t = t_lo
        return x_of(t), y_of(t)

    def _round(self, relaxed, opt: LlmOption, enc, gen) -> list[Evaluation]:
        """Exact evaluations of the integer layouts around a continuous optimum."""
        x, y = relaxed
        N = self.m.devices
        width = opt.width
        g_gpus = gen.gpus if gen is not None and not gen.colocated else 0
        sep_enc = enc is not None and not enc.colocated
        llm_pps = self.llm_pp_options(opt.vpp, opt.dp)
        enc_pps = self.enc_pp_options() if sep_enc else [1]

        def around(options: list[int], value: float) -> set[int]:
            below = [p for p in options if p <= value]
            above = [p for p in options if p > value]
            picks = set(below[-2:]) | set(above[:2])
            return picks or {options[0]}

        enc_candidates = around(enc_pps, x / (enc.tp * enc.dp)) if sep_enc else {1}
        results = []
        seen = set()
        for pe in sorted(enc_candidates):
            e_gpus = pe * enc.tp * enc.dp if sep_enc else 0
            room = N - g_gpus - e_gpus
            fitting = [p for p in llm_pps if p * width <= room]
            if not fitting:
                continue
            llm_candidates = around(fitting, y / width) | {fitting[-1]}
            for pl in llm_candidates:
                # with this LLM size, the largest encoder that still fits is a candidate too
                pes = {pe}
                if sep_enc:
                    left = N - g_gpus - pl * width
                    fit_e = [p for p in enc_pps if p * enc.tp * enc.dp <= left]
                    if fit_e:
                        pes.add(fit_e[-1])
                for pe2 in pes:
                    key = (pe2, pl)
                    if key in seen:
                        continue
                    seen.add(key)
                    e = UnitChoice(enc.tp, enc.dp, pe2) if sep_enc else enc
                    results.append(self.m.evaluate(opt.choice(pl), e, gen))
        return results

    # ------------------------------------------------------------------- messages
    def no_layout_reason(self) -> str:
        """Name the binding constraint when nothing is feasible (planner/infeasible.py)."""
        return no_layout_reason(self)
