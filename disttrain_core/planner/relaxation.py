"""Algorithm 1's continuous relaxation of one combination and the integer layouts around its optimum."""

from __future__ import annotations

from scipy.optimize import brentq, minimize_scalar

from .evaluate import SIDE_ENCODERS, Evaluation, UnitChoice
from .options import LlmOption


class Relaxation:
    """Mixed into planner/solver.py's Orchestrator (``self.m``: its LayoutModel; the option enumeration)."""

    def _relax(self, opt: LlmOption, enc, gen, bounds, audio: dict | None = None) -> tuple[float, float, dict]:
        """Continuous optimum (encoder devices x, LLM devices y) of one combination.

        The convex problem in (x, y, t) reduces to one dimension: for a steady-phase stage time
        ``t`` the fewest devices that achieve it are ``x(t) = max(x_lo, K_e / (t - c_e))`` and
        ``y(t) = max(y_lo, K_l / (t - c_l))`` (convex, decreasing), so the objective
        ``(m - 1) t + w_x x(t) + w_y y(t)`` is convex in ``t`` on the interval where the bounds
        and the budget ``x(t) + y(t) <= D`` hold. scipy finds the interval's end with ``brentq``
        and the minimum with a bounded ``minimize_scalar``. A separate audio unit is one more device count,
        ``a(t) = max(a_lo, min(a_hi, K_a / t))`` inside the budget (planner/audio_search.py). Returns (x, y, the
        audio units' device counts).
        """
        mdl, c = self.m, self.m.c
        tp, vpp = opt.tp, opt.vpp
        B = mdl.micro * opt.dp
        m = mdl.batch // B
        bw = mdl.pp_bw(mdl.devices)
        sep_enc = enc is not None and not enc.colocated
        g_gpus = gen.gpus if gen is not None and not gen.colocated else 0
        t_g = c.compute("generator", gen.tp, B / gen.dp) / gen.pp if g_gpus else 0.0
        sides = self.audio_relax_terms(audio or {}, B)
        x_e = mdl.colocated_time("encoder", tp, mdl.micro) if enc is not None and enc.colocated else 0.0
        x_g = mdl.colocated_time("generator", tp, mdl.micro) if gen is not None and gen.colocated else 0.0
        a_l = opt.width
        K_l = c.rank_compute("llm", tp, mdl.micro, opt.cp, opt.ep, opt.cp_mode, opt.cp_ulysses) * a_l
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
        a_lo = sum(lo for _, _, lo, _ in sides)
        if x_lo + y_lo + a_lo > D:
            return x_lo, y_lo, {name: lo for name, _, lo, _ in sides}

        # Devices a stage time t needs; t_lo sits at the upper bounds, where t - c can round to 0 when c
        # dwarfs the compute term (extreme workloads): the bound it was chosen for, not a division by zero.
        def x_of(t: float) -> float:
            if not sep_enc:
                return 0.0
            return max(x_lo, min(x_hi, K_e / (t - c_e))) if t > c_e else x_hi

        def y_of(t: float) -> float:
            return max(y_lo, min(y_hi, K_l / (t - c_l))) if t > c_l else y_hi

        def a_of(t: float) -> float:
            return sum(max(lo, min(hi, work / t)) for _, work, lo, hi in sides)

        def used(t: float) -> float:
            return x_of(t) + y_of(t) + a_of(t)

        def objective(t: float) -> float:
            return (m - 1) * t + c_e / a_e * x_of(t) + p_l / (a_l * vpp) * y_of(t)

        audio_lo = max((work / hi for _, work, _, hi in sides), default=0.0)
        audio_hi = max((work / lo for _, work, lo, _ in sides), default=0.0)
        t_lo = max(t_g, c_l + K_l / y_hi, (c_e + K_e / x_hi) if sep_enc else 0.0, audio_lo)
        t_hi = max(t_g, c_l + K_l / y_lo, (c_e + K_e / x_lo) if sep_enc else 0.0, audio_hi)

        def result(t: float) -> tuple[float, float, dict]:
            return x_of(t), y_of(t), {name: max(lo, min(hi, work / t)) for name, work, lo, hi in sides}

        if used(t_lo) > D:  # the budget binds: the smallest t whose devices fit
            if used(t_hi) >= D:  # only the lower bounds fit (up to rounding)
                return result(t_hi)
            t_lo = brentq(lambda t: used(t) - D, t_lo, t_hi, xtol=1e-12 * max(t_hi, 1e-12))
        if t_hi - t_lo > 1e-12 * t_hi and (c_e > 0 or p_l > 0):
            t = minimize_scalar(objective, bounds=(t_lo, t_hi), method="bounded").x
            t = t if objective(t) < objective(t_lo) else t_lo
        else:
            t = t_lo
        return result(t)

    def _round(self, relaxed, opt: LlmOption, enc, gen, audio: dict | None = None) -> list[Evaluation]:
        """Exact evaluations of the integer layouts around a continuous optimum (each separate audio unit at the
        sizes around its relaxed device count)."""
        x, y, sized = relaxed
        audio = audio or {}
        placements: list[dict] = [{}]
        for name, side in audio.items():
            near = [side] if side.colocated else self.audio_sizes_near(side, sized.get(name, 0.0))
            placements = [{**done, name: choice} for done in placements for choice in near]
        results = []
        for concrete in placements:
            results += self._round_one((x, y), opt, enc, gen, concrete)
        return results

    def _round_one(self, relaxed, opt: LlmOption, enc, gen, audio: dict) -> list[Evaluation]:
        """``_round`` for one concrete placement of the audio units."""
        x, y = relaxed
        N = self.m.devices
        width = opt.width
        side = self.m.separate(audio, *audio)
        g_gpus = gen.gpus if gen is not None and not gen.colocated else 0
        g_gpus += sum(ch.gpus for _, ch in side)
        sep_enc = enc is not None and not enc.colocated
        llm_pps = self.llm_pp_options(opt.vpp, opt.dp)
        enc_pps = self.enc_pp_options(enc.tp) if sep_enc else [1]
        if any(name in SIDE_ENCODERS for name, _ in side):  # beside the audio or video tower: one stage
            enc_pps = [1]

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
                    results.append(self.m.evaluate(opt.choice(pl), e, gen, audio))
        return results
