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
steady-phase stage time alone, which scipy solves (``Relaxation._relax``). The
continuous optimum is rounded to pipeline sizes that divide the layer counts (the
nearest ones below and above, and the largest that fits the remaining devices), each
candidate is evaluated exactly (planner/evaluate.py), and the best feasible one is kept.

The search is best first over bounds (planner/bounds.py): LLM options, then their combinations, then each
combination's refined bound leave one heap in order; once the least bound left reaches the best time found, the
rest cannot win and are skipped. That makes the search exact with respect to its own rounding while solving only
a small fraction of the convex problems (planner/relaxation.py).

The LLM's options also carry context parallelism ``cp`` and expert parallelism ``ep`` (which sizes:
planner/options.py): its devices per stage are then ``tp x cp x dp`` and ``K = C(tp, cp, ep) * tp * cp * dp``,
with ``C`` a rank's time (planner/costs.py ``rank_compute``).

The audio tower and the audio generator (models with them) are units too: colocated in the LLM unit, or on
devices of their own beside the image encoder / generator (one pipeline stage each, so a separate image encoder
beside a separate audio tower has pp=1, and the same for the generators). Each LLM option enters the heap once per
placement; a separate unit's size is one more device count of the relaxation (planner/audio_search.py).

``solver=exhaustive`` evaluates every integer layout with the same model and options, for checking on small
clusters.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from .audio_search import AudioSearch
from .bounds import SearchBounds
from .costs import PlanningError
from .evaluate import AUDIO_UNITS, COLOCATED, SIDE_ENCODERS, Evaluation, LayoutModel, UnitChoice
from .infeasible import no_layout_reason
from .options import CP_MIN_TOKENS, CP_OPTIONS, LlmOption, cp_candidates, cp_mode_candidates, divisors, ep_candidates
from .relaxation import Relaxation

TP_OPTIONS = (1, 2, 4, 8)


@dataclass
class Plan:
    name: str
    evaluation: Evaluation
    devices: int
    solve_seconds: float = 0.0
    candidates: int = 0  # convex problems solved (or layouts evaluated)
    baselines: dict[str, Plan] = field(default_factory=dict)


class Orchestrator(SearchBounds, Relaxation, AudioSearch):
    """Algorithm 1 over one LayoutModel: the options, their memory bounds and the best-first search (the bounds:
    planner/bounds.py; the convex relaxation and its rounding: planner/relaxation.py)."""

    def __init__(
        self,
        model: LayoutModel,
        tp_options=TP_OPTIONS,
        vpp_options=(1,),
        allow_colocation: bool = True,
        cp_options=CP_OPTIONS,
        min_cp_tokens: int = CP_MIN_TOKENS,
        allow_ep: bool = True,
        cp_modes: tuple[str, ...] | None = None,
    ):
        self.m = model
        self.cp_mode_filter = cp_modes  # None: every mode the heads allow (tools/plan_cp_modes.py restricts it)
        c, w = model.c, model.w
        self.w = w
        per_node = c.hw.per_node
        self.tp_options = [t for t in tp_options if t <= per_node]
        self.vpp_options = tuple(vpp_options)
        self.allow_colocation = allow_colocation
        self.has_enc = w.get("encoder") is not None
        self.has_gen = w.get("generator") is not None
        self.audio_units = tuple(name for name in AUDIO_UNITS if name in w.units)
        self._audio: dict[tuple[str, int], list[UnitChoice]] = {}  # audio_options per (unit, samples)
        self.cp_options = cp_candidates(w.seq_len, cp_options, min_cp_tokens)  # planner/options.py
        self.allow_ep = allow_ep
        self._llm_parts: dict[tuple, tuple[float, float, float] | None] = {}  # refined_bound's LLM terms
        self._stage_times: dict[tuple, float] = {}
        self._pps: dict[tuple[int, int], tuple[int, ...]] = {}  # LLM pipeline sizes per (vpp, dp)

    # ------------------------------------------------------------------ enumeration
    def tp_ok(self, unit: str, tp: int) -> bool:
        """Can ``unit`` run at ``tp``? The LLM's TP group also splits the audio and video towers it holds."""
        riders = tuple(n for n in SIDE_ENCODERS if n in self.w.units) if unit == "llm" else ()
        return all(self.w.units[name].tp_allowed(tp) for name in (unit, *riders))

    def llm_pp_options(self, vpp: int, dp: int = 1) -> list[int]:
        """Pipeline sizes of the LLM: divisors of its blocks into pp x vpp stages. Virtual stages (vpp > 1) need
        pp >= 2 and, as the runtime's interleaved 1F1B does, a microbatch count (at ``dp`` replicas) that is a
        multiple of pp."""
        return list(self._llm_pps(vpp, dp))

    def _llm_pps(self, vpp: int, dp: int) -> tuple[int, ...]:
        found = self._pps.get((vpp, dp))
        if found is None:
            layers = self.w.units["llm"].layers
            m = self.m.batch // (self.m.micro * dp)
            found = self._pps[vpp, dp] = tuple(
                p
                for p in divisors(layers)
                if layers % (p * vpp) == 0 and (vpp == 1 or (p > 1 and m % p == 0 and m >= p))
            )
        return found

    def enc_pp_options(self, tp: int = 1) -> list[int]:
        """The encoder unit's stages. With tensor parallelism, one: an encoder at tp x pp > 1 has no proven run
        (its smallest replica beside an LLM unit needs 9 processes; conf/proven_compositions.yaml), so the search
        leaves it out. The lower bounds (planner/bounds.py) may keep it: a wider set only loosens them."""
        if tp > 1 or not self.has_enc:
            return [1]
        return divisors(self.w.units["encoder"].layers)

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
                            for mode, ulysses in self.cp_modes(cp, tp):
                                yield LlmOption(tp, dp, vpp, cp, ep, mode, ulysses)

    def cp_modes(self, cp: int, tp: int) -> tuple[tuple[str, int], ...]:
        """How ``cp`` ranks may attend at ``tp`` (planner/options.py ``cp_mode_candidates``)."""
        llm = self.w.units["llm"]
        modes = cp_mode_candidates(cp, tp, int(llm.heads), int(llm.kv_heads or llm.heads), self.m.c.hw.per_node)
        return tuple(m for m in modes if self.cp_mode_filter is None or m[0] in self.cp_mode_filter)

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
        for pp in self.enc_pp_options(enc.tp):
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
        """Every (lower bound, LLM option, encoder option, generator option, device bounds)."""
        for _, opt, context in self.llm_entries():
            yield from self.expand(opt, context)

    def solve(self) -> Plan:
        """Best first: LLM options (one entry per placement of the audio units), then their combinations, leave one
        heap in order of their bounds. An LLM option that leaves it is expanded into its combinations; a combination
        that leaves it the first time has its bound refined (``refined_bound``) and goes back, the second time it is
        relaxed and rounded. The search stops when the least bound left reaches the best layout found: no
        combination left can beat it."""
        started = time.perf_counter()
        N = self.m.devices
        heap: list = []
        items: list = []

        def push(bound: float, item, stage: int) -> None:
            heapq.heappush(heap, (bound, len(items), stage))
            items.append(item)

        for lower, opt, context in self.llm_entries():
            push(lower, (opt, context), 0)
        best: Evaluation | None = None
        solved = 0
        while heap:
            lower, index, stage = heapq.heappop(heap)
            if best is not None and lower >= best.iteration_s * (1 - 1e-9):
                break
            if stage == 0:
                for combo in self.expand(*items[index]):
                    push(combo[0], combo[1:], 1)
                continue
            opt, enc, gen, bounds, audio = items[index]
            if stage == 1:
                tighter = self.refined_bound(opt, enc, gen, bounds, audio)
                if tighter < float("inf"):
                    push(max(lower, tighter), items[index], 2)
                continue
            solved += 1
            relaxed = self._relax(opt, enc, gen, bounds, audio)
            for candidate in self._round(relaxed, opt, enc, gen, audio):
                if candidate.feasible and (best is None or candidate.iteration_s < best.iteration_s):
                    best = candidate
        if best is None:
            raise PlanningError(self.no_layout_reason())
        return Plan("disttrain", best, N, time.perf_counter() - started, solved)

    # ------------------------------------------------------------------- messages
    def no_layout_reason(self) -> str:
        """Name the binding constraint when nothing is feasible (planner/infeasible.py)."""
        return no_layout_reason(self)
