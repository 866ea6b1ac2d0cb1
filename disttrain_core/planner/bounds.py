"""The bounds of Algorithm 1's best-first search (planner/solver.py ``Orchestrator.solve``).

Three bounds, each below every integer layout it stands for (the search skips whatever its bound says cannot win,
so a bound above a layout would lose it; tests/unit/test_planner_search.py compares with exhaustive search):

* an LLM option's, per placement of the audio units (``llm_entries``): its compute on the largest pipeline that
  fits beside the separate audio units, the riding audio modules on its end stages, its least ZeRO-1 tail;
* a combination's cheap one (``expand``): every unit's warm-up on one stage, the steady phase balanced over all
  devices and at least the largest LLM pipeline that fits;
* a combination's refined one (``refined_bound``): the LLM exact (recompute policy, shard mode, stage times) at
  every pipeline size the combination allows, the other units at their least.
"""

from __future__ import annotations

import bisect

from .evaluate import SIDE_ENCODERS, UnitChoice
from .options import LlmOption
from .schedule_choice import BUBBLE_SHARE


class SearchBounds:
    """Mixed into planner/solver.py's Orchestrator (``self.m``: its LayoutModel; the option enumeration)."""

    def _fill_bound(self, fill: float, steady: float) -> float:
        """The fill a bound may count: 1F1B's, or where planner.schedules lets a zero-bubble schedule charge only
        a share of the bubble (planner/schedule_choice.py), no more than one more steady stage."""
        if any(name in BUBBLE_SHARE for name in self.m.c.settings.schedules):
            return min(fill, steady)
        return fill

    def llm_entries(self):
        """(lower bound, LlmOption, its context) per LLM option that can fit: the bound holds for every combination
        of the option (``expand``), so the search expands an option only when its bound can still win."""
        N, mdl = self.m.devices, self.m
        fastest = max(mdl.c.hw.intra_bw, mdl.c.hw.inter_bw)  # a bound must not assume the slower link
        for opt in self.llm_options():
            tp, dp, vpp, cp, ep = opt.tp, opt.dp, opt.vpp, opt.cp, opt.ep
            m = mdl.batch // (mdl.micro * dp)
            pl_min = self.llm_pp_min(opt, m)
            if pl_min is None:
                continue
            pps = self._llm_pps(vpp, dp)
            fitting = [p for p in pps if p >= pl_min and opt.width * p <= N]
            if not fitting:
                continue
            C_l = mdl.c.rank_compute("llm", tp, mdl.micro, cp, ep, opt.cp_mode, opt.cp_ulysses)
            p2p_l = mdl.c.p2p_s(mdl.llm_boundary_bytes(mdl.micro, cp), fastest)
            # zero1's traffic: the least of every shard mode (FSDP2 moves it per microbatch without a pipeline and
            # once per step, as zero1, under one), with the optimizer step
            tails = {
                pp: mdl.c.sync_s("llm", tp, dp, pp, "zero1", 1, cp, ep) + mdl.c.optimizer_s("llm", tp, dp, pp, cp, ep)
                for pp in pps
            }
            p2p = p2p_l if pl_min > 1 else 0.0
            K_l = C_l * opt.width
            least_tail = min(tails[p] for p in fitting)
            for audio in self.audio_placements(mdl.micro * dp):
                terms = self.audio_terms(opt, audio)
                x_first, x_last, t_ae, t_ag, g_a, K_a = terms
                room = [p for p in fitting if opt.width * p <= N - g_a]
                if not room:
                    continue
                ends = max(x_first, x_last)  # a riding module on the first / last stage (both: pp=1, more)
                steady = max(K_l / (opt.width * room[-1]) + p2p + ends, K_l / (N - g_a), (K_l + K_a) / N, t_ae, t_ag)
                fill = (C_l + pl_min * p2p + x_first + x_last) / vpp + t_ae + t_ag
                lower = self._fill_bound(fill, steady) + (m - 1) * steady + least_tail
                yield lower, opt, (m, pl_min, pps, C_l, p2p, tails, audio, terms)

    def expand(self, opt: LlmOption, context):
        """Every (lower bound, opt, encoder option, generator option, device bounds, audio placement) of one LLM
        option and audio placement (a separate audio unit beside a separate image encoder / generator holds it at
        one stage)."""
        mdl = self.m
        m, pl_min, pps, C_l, p2p, tails, audio, (x_ae, x_ag, t_ae, t_ag, g_a, K_a) = context
        N = mdl.devices - g_a  # what the separate audio units leave
        beside_enc = any(n in SIDE_ENCODERS and not ch.colocated for n, ch in audio.items())
        beside_gen = any(n == "audio_generator" and not ch.colocated for n, ch in audio.items())
        tp, dp, vpp = opt.tp, opt.dp, opt.vpp
        B = mdl.micro * dp
        a_l = opt.width
        K_l = C_l * a_l
        widths = [a_l * p for p in pps]
        enc_pps = [1] if beside_enc else self.enc_pp_options()
        spread = mdl.c.settings.pp_split
        gens = []
        for gen in self.side_options("generator", B):
            if gen is None:
                gens.append((gen, x_ag, t_ag, 0, t_ag))
            elif gen.colocated:
                gens.append((gen, mdl.colocated_time("generator", tp, mdl.micro) + x_ag, t_ag, 0, t_ag))
            elif self.gen_fits(gen, B / gen.dp) and not (beside_gen and gen.pp > 1):
                # (its stage time in the steady phase, its whole time in the fill; beside the audio generator's)
                whole = mdl.c.compute("generator", gen.tp, B / gen.dp)
                gens.append((gen, x_ag, max(whole / gen.pp, t_ag), gen.gpus, max(whole, t_ag)))
        low = bisect.bisect_left(pps, pl_min)
        for enc in self.side_options("encoder", B):
            x_e, C_e = x_ae, 0.0  # the riding audio tower (a separate one: its row, t_ae)
            a_e = pe_min = 0
            if enc is not None and enc.colocated:
                x_e += mdl.colocated_time("encoder", tp, mdl.micro)
            elif enc is not None:
                pe_min = self.enc_pp_min(enc, B / enc.dp, m, pl_min)
                if pe_min is None or pe_min > enc_pps[-1]:
                    continue
                a_e = enc.tp * enc.dp
                C_e = mdl.c.compute("encoder", enc.tp, mdl.images(B / enc.dp))
            K_e = C_e * a_e
            x_min = a_e * pe_min
            for gen, x_g, t_g, g_gpus, fill_g in gens:
                budget = N - g_gpus
                top = bisect.bisect_right(widths, budget - x_min)  # LLM sizes from pl_min that leave x_min
                if top <= low:
                    continue
                y_max = widths[top - 1]
                if a_e:
                    room = budget - a_l * pl_min
                    e_top = bisect.bisect_right(enc_pps, room // a_e)
                    if e_top == 0 or enc_pps[e_top - 1] < pe_min:
                        continue
                    x_max = a_e * enc_pps[e_top - 1]
                else:
                    x_max = 0
                # the colocated modules sit on the end stages, or spread over all by a balanced parallel.pp_split
                ends = max(x_e, x_g) if spread is None else (x_e + x_g) / pps[top - 1]
                steady = max(
                    t_g,
                    t_ae,
                    K_l / y_max + p2p + ends,
                    K_e / x_max if x_max else 0.0,
                    (K_e + K_l) / budget,
                    (K_e + K_l + K_a) / (budget + g_a),  # the separate audio units' work on their devices too
                )
                # the colocated modules run on the LLM's end stages, whose fill shares its virtual stages
                fill = max(C_e, t_ae) + (C_l + pl_min * p2p + x_e + x_g) / vpp + fill_g
                lower = self._fill_bound(fill, steady) + (m - 1) * steady + tails[pps[top - 1]]
                yield lower, opt, enc, gen, ((x_min, x_max), (a_l * pl_min, y_max)), audio

    def refined_bound(self, opt: LlmOption, enc, gen, bounds, audio: dict | None = None) -> float:
        """A tighter lower bound of one combination (inf: no layout of it fits): the least, over the LLM pipeline
        sizes its bounds allow, of the iteration with the LLM's own recompute policy and shard mode (the first that
        fits, as ``evaluate`` picks them), so the LLM's exact stage times, fill and data-parallel tail, on the link
        of the fewest devices the combination can use; the separate encoder on the most devices the LLM leaves it
        and on its fewest stages in the fill; separate audio units at their own stage times, side by side with the
        image encoder / generator row. The other units' recompute and shard modes are left out: what ``evaluate``
        adds to each layout only adds."""
        mdl, c = self.m, self.m.c
        B = mdl.micro * opt.dp
        m = mdl.batch // B
        audio = audio or {}
        (x_min, _), (y_min, y_max) = bounds
        sep_enc = enc is not None and not enc.colocated
        sep_gen = gen is not None and not gen.colocated
        side = dict(mdl.separate(audio, *audio)) if audio else {}
        riders = tuple((name, ch.colocated) for name, ch in sorted(audio.items()))  # what the LLM sees of them
        beside_enc, beside_gen = any(n in SIDE_ENCODERS for n in side), "audio_generator" in side
        bw_free = max(c.hw.intra_bw, c.hw.inter_bw)
        g_gpus = (gen.gpus if sep_gen else 0) + sum(ch.gpus for ch in side.values())
        gen_rows = gen.pp if sep_gen else int(beside_gen)
        a_e = enc.tp * enc.dp if sep_enc else 1
        enc_pps = [p for p in self.enc_pp_options() if a_e * p >= x_min] if sep_enc else []
        monotone = c.hw.intra_bw >= c.hw.inter_bw  # more devices, no faster a link
        best = float("inf")
        for pp in self._llm_pps(opt.vpp, opt.dp):
            y = opt.width * pp
            if not y_min <= y <= y_max:
                continue
            fewest = y + g_gpus
            if sep_enc and beside_enc:
                room = [1] if enc_pps and enc_pps[0] == 1 and a_e + fewest <= mdl.devices else []
                if not room:
                    continue
                fewest += a_e
            elif sep_enc:
                left = (mdl.devices - g_gpus - y) // a_e
                room = enc_pps[: bisect.bisect_right(enc_pps, left)]
                if not room:
                    continue
                fewest += a_e * room[0]
            elif fewest > mdl.devices:
                continue
            bw = c.link_bw(fewest) if monotone else bw_free
            first_enc = UnitChoice(enc.tp, enc.dp, room[0]) if sep_enc else enc
            S = (room[0] if sep_enc else int(beside_enc)) + pp + gen_rows
            llm = self._llm_part(opt, pp, first_enc, gen, S, m, bw, audio, riders)
            if llm is None:  # no recompute policy and shard mode fit the LLM
                continue
            fill, steady, tail = llm
            enc_fill = gen_fill = 0.0
            if sep_enc:
                samples = B / enc.dp
                enc_fill = room[0] * self._stage_time("encoder", first_enc, samples, bw)
                steady = max(steady, self._stage_time("encoder", UnitChoice(enc.tp, enc.dp, room[-1]), samples, bw))
            if sep_gen:
                gen_fill = gen.pp * self._stage_time("generator", gen, B / gen.dp, bw)
                steady = max(steady, gen_fill / gen.pp)
            for name, ch in side.items():  # one stage beside the image encoder's / generator's row
                t = self.audio_fastest_stage(name, ch, B, bw)
                steady = max(steady, t)
                if name in SIDE_ENCODERS:
                    enc_fill = max(enc_fill, t)
                else:
                    gen_fill = max(gen_fill, t)
            best = min(best, self._fill_bound(fill + enc_fill + gen_fill, steady) + (m - 1) * steady + tail)
        return best

    def _llm_part(self, opt: LlmOption, pp: int, enc, gen, S: int, m: int, bw: float, audio: dict, riders: tuple):
        """(fill, steady stage time, data-parallel tail) of the LLM at ``pp`` stages beside these units, with its
        recompute policy and shard mode as ``evaluate`` picks them; None where none fits. ``riders``: each audio
        unit's (name, colocated), all the LLM sees of them."""
        # What the LLM's memory and stage times see of the other units (LayoutModel._memory_key, llm_end_extras,
        # breakdown.role_memory's stages after it and ``S > 1``): a colocated module itself; a separate encoder only
        # as being there; a separate generator by its stage count
        enc_key = enc if enc is None or enc.colocated else "separate"
        gen_key = gen if gen is None or gen.colocated else ("separate", gen.pp)
        key = (opt, pp, enc_key, gen_key, bw, riders)
        cached = self._llm_parts.get(key, False)
        if cached is not False:
            return cached
        mdl, c = self.m, self.m.c
        llm = opt.choice(pp)
        choices = {"llm": llm, **audio}
        if enc is not None:
            choices["encoder"] = enc
        if gen is not None:
            choices["generator"] = gen
        policy, used, shard = mdl.unit_fit("llm", choices, S, m)
        result = None
        if used <= mdl.limit:
            t_llm = mdl.stage_time("llm", llm, mdl.micro, bw, policy)
            first, last = mdl.llm_end_extras(llm, enc, gen, bw, policy, choices)
            if pp == 1:
                ends = first + last
            else:  # on the first and last stage; a balanced parallel.pp_split may spread them over all
                ends = max(first, last) if c.settings.pp_split is None else (first + last) / pp
            fill = (pp * t_llm + first + last) / opt.vpp
            result = (fill, t_llm + ends, mdl.unit_tail("llm", llm, opt.dp, shard, m, S > 1))
        self._llm_parts[key] = result
        return result

    def _stage_time(self, unit: str, choice: UnitChoice, samples: float, bw: float) -> float:
        """A separate unit's stage time without recompute (the least of its policies), cached."""
        key = (unit, choice, samples, bw)
        found = self._stage_times.get(key)
        if found is None:
            found = self._stage_times[key] = self.m.stage_time(unit, choice, samples, bw, "none")
        return found
