"""The audio units in Algorithm 1's search (planner/solver.py): where the audio tower and the audio generator run,
and how many devices a separate one gets.

Each is *colocated* in the LLM unit (the tower on its first stage, the generator on its last, at its tp) or a unit
of its own: one pipeline stage, a data-parallel size dividing the samples of a slot, at the least TP that fits
(``audio_options``; Whisper large-v3's encoder and AudioLDM-L are under a billion parameters). The search enters
each LLM option once per placement (riding or separate, per unit: four with both units); a separate unit's size is
then a device count of the convex relaxation, as the encoder's is (``SizedLater``): ``a(t) = K_a / t`` devices
keep its stage time under the steady-phase time ``t``, with ``K_a`` its device-seconds per microbatch. The
rounding evaluates the sizes around the relaxed optimum. The bounds count a separate unit at its least: its
fewest devices, its fastest stage, its least device-seconds (each a lower bound of every size).
"""

from __future__ import annotations

from dataclasses import dataclass

from .evaluate import COLOCATED, SIDE_ENCODERS, UnitChoice
from .options import divisors


@dataclass(frozen=True)
class SizedLater:
    """A separate audio unit whose size the relaxation and its rounding choose, from ``options`` (fewest devices
    first)."""

    options: tuple[UnitChoice, ...]
    colocated: bool = False
    pp: int = 1

    @property
    def gpus(self) -> int:
        return self.options[0].gpus


class AudioSearch:
    """Mixed into the Orchestrator (``self.m``: its LayoutModel, ``self.audio_units``, ``self._audio``)."""

    def audio_options(self, unit: str, samples: int) -> list[UnitChoice]:
        """A separate ``unit``'s sizes: one stage at each dp dividing the slot's samples, with the least TP that
        fits (a lower bound of its memory: its state and one microbatch's activations)."""
        key = (unit, samples)
        if key not in self._audio:
            options, c = [], self.m.c
            for dp in divisors(samples):
                for tp in self.tp_options:
                    if not self.tp_ok(unit, tp) or tp * dp > self.m.devices:
                        continue
                    items = self.m.items(unit, samples / dp)
                    if self._fits(c.state_bytes(unit, tp, dp, 1) + c.activation_bytes(unit, tp, items)):
                        options.append(UnitChoice(tp=tp, dp=dp, pp=1))
                        break
            self._audio[key] = sorted(options, key=lambda o: o.gpus)
        return self._audio[key]

    def audio_placements(self, samples: int) -> list[dict]:
        """Riding or separate (sized later), per audio unit: the search's audio choices of an LLM option."""
        found: list[dict] = [{}]
        for unit in self.audio_units:
            options = self.audio_options(unit, samples)
            kinds = [COLOCATED] + ([SizedLater(tuple(options))] if options else [])
            found = [{**done, unit: kind} for done in found for kind in kinds]
        return found

    def audio_products(self, samples: int) -> list[dict]:
        """Every concrete placement: riding, or each size (exhaustive search)."""
        found: list[dict] = [{}]
        for unit in self.audio_units:
            kinds = [COLOCATED, *self.audio_options(unit, samples)]
            found = [{**done, unit: kind} for done in found for kind in kinds]
        return found

    def audio_least(self, name: str, side, samples: int) -> tuple[float, float]:
        """(fastest compute per microbatch, least device-seconds per microbatch) of a separate audio unit over its
        sizes, for ``samples`` samples of a slot."""
        c, m = self.m.c, self.m
        options = side.options if isinstance(side, SizedLater) else (side,)
        times = [(c.compute(name, o.tp, m.items(name, samples / o.dp)), o.gpus) for o in options]
        return min(t for t, _ in times), min(t * g for t, g in times)

    def audio_terms(self, opt, audio: dict) -> tuple[float, float, float, float, int, float]:
        """What a placement of the audio units adds for an LLM option, each term at its least: (seconds on the
        LLM's first stage, on its last: the riding modules; the separate audio and video towers' (the slower's) and
        audio generator's fastest compute per microbatch; their fewest devices; their least device-seconds per
        microbatch)."""
        mdl = self.m
        B = mdl.micro * opt.dp
        x_first = x_last = t_ae = t_ag = K_a = 0.0
        g_a = 0
        for name, ch in audio.items():
            if ch.colocated:
                t = mdl.colocated_time(name, opt.tp, mdl.micro)
                x_first, x_last = (x_first + t, x_last) if name in SIDE_ENCODERS else (x_first, x_last + t)
                continue
            t, work = self.audio_least(name, ch, B)  # units side by side: their row takes the slower one's time
            t_ae, t_ag = (max(t_ae, t), t_ag) if name in SIDE_ENCODERS else (t_ae, max(t_ag, t))
            g_a += ch.gpus
            K_a += work
        return x_first, x_last, t_ae, t_ag, g_a, K_a

    def audio_relax_terms(self, audio: dict, samples: int) -> list[tuple[str, float, float, float]]:
        """(name, least device-seconds per microbatch, fewest devices, most devices) of each separate audio unit:
        its device count in the relaxation (planner/relaxation.py)."""
        terms = []
        for name, side in self.m.separate(audio, *audio):
            options = side.options if isinstance(side, SizedLater) else (side,)
            work = self.audio_least(name, side, samples)[1]
            terms.append((name, work, float(options[0].gpus), float(options[-1].gpus)))
        return terms

    def audio_fastest_stage(self, name: str, side, samples: int, bw: float) -> float:
        """The least stage time (compute and boundary send) over a separate audio unit's sizes."""
        options = side.options if isinstance(side, SizedLater) else (side,)
        return min(self._stage_time(name, o, samples / o.dp, bw) for o in options)

    def audio_sizes_near(self, side, devices: float) -> list[UnitChoice]:
        """The sizes of a separate unit around a relaxed device count: two below, two above, and the largest (spare
        devices shorten its row in the fill; a concrete one: itself)."""
        if not isinstance(side, SizedLater):
            return [side]
        below = [o for o in side.options if o.gpus <= devices]
        above = [o for o in side.options if o.gpus > devices]
        return list(dict.fromkeys([*below[-2:], *above[:2], side.options[-1]]))
