"""EDiT's pseudo-gradient penalty (the paper's Algorithm 2), per sync unit (a decoder block, or everything
outside the blocks):

* G_m, the norm of worker m's pseudo-gradient over the whole unit;
* anomaly elimination: per (unit, worker) an exponentially weighted mean and variance of G, updated only from
  values judged normal, and after ``ewma_warmup`` updates a one-sided z-test -- a norm more than ``threshold``
  standard deviations *above* the mean is anomalous (a small norm never is); an anomalous worker's
  pseudo-gradient gets weight 0;
* weighting: softmax(-G / ``temperature``) over the normal workers (otherwise equal weights);
* clipping of the combined pseudo-gradient to ``clip`` per unit (EDiT's FSDP path clips per layer);
* rollback: when every worker of a unit is anomalous, the unit's outer step is skipped and every worker
  takes the anchor back (the parameters of the last sync).

Every process sees every worker's G (one all-gather over its sync group), so every process runs the same
detectors on the same values and reaches the same verdicts: no verdict is communicated.

Two departures from the public implementation (shared/reference/algorithms.md 2.3): statistics are updated
from normal values only (its FSDP path also updates them with the inflated value of an outlier), and the
first value seeds the mean (with a zero start an EWMA of alpha 0.02 sits far below the norms for hundreds of
syncs); the dynamic threshold factor of its detector (a window of recent z-scores) is not used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Ewma:
    """Exponentially weighted mean and variance of one worker's norms in one unit."""

    alpha: float
    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def z(self, value: float) -> float:
        std = math.sqrt(self.m2)
        return (value - self.mean) / std if self.count >= 2 and std > 0 else 0.0

    def update(self, value: float) -> None:
        self.count += 1
        if self.count == 1:
            self.mean = value
            return
        delta = value - self.mean
        self.mean += self.alpha * delta
        self.m2 = (1 - self.alpha) * (self.m2 + self.alpha * delta * (value - self.mean))

    def state(self) -> list[float]:
        return [float(self.count), self.mean, self.m2]

    def load(self, values: list[float]) -> None:
        self.count, self.mean, self.m2 = int(values[0]), float(values[1]), float(values[2])


class Penalty:
    def __init__(self, cfg, units: int, workers: int, anomaly: bool | None = None, weighting: bool | None = None):
        """``cfg``: parallel.local_sgd.penalty; ``anomaly`` / ``weighting``: the method's resolved switches
        (parallel/plan.py local_sgd_features), else the settings'."""
        self.cfg = cfg
        self.anomaly = bool(cfg.anomaly) if anomaly is None else anomaly
        self.weighting = bool(cfg.weighting) if weighting is None else weighting
        self.detectors = [[Ewma(float(cfg.ewma_alpha)) for _ in range(workers)] for _ in range(units)]

    @property
    def active(self) -> bool:
        return bool(self.anomaly or self.weighting or self.cfg.clip is not None)

    def verdict(self, unit: int, norms: list[float]) -> tuple[list[float], list[bool]]:
        """(weights summing to 1 -- all 0 when every worker is anomalous --, anomalous flags) of one unit's
        sync from the workers' pseudo-gradient norms; updates the statistics of the normal workers."""
        c = self.cfg
        flags = [False] * len(norms)
        if self.anomaly:
            for m, (detector, norm) in enumerate(zip(self.detectors[unit], norms, strict=True)):
                ready = detector.count >= int(c.ewma_warmup)
                flags[m] = bool(ready and detector.z(norm) > float(c.threshold)) or not math.isfinite(norm)
                if not flags[m]:
                    detector.update(norm)
        normal = [m for m, flag in enumerate(flags) if not flag]
        weights = [0.0] * len(norms)
        if not normal:
            return weights, flags
        if self.weighting:
            scores = [-norms[m] / float(c.temperature) for m in normal]
            top = max(scores)
            exps = [math.exp(s - top) for s in scores]
            for m, e in zip(normal, exps, strict=True):
                weights[m] = e / sum(exps)
        else:
            for m in normal:
                weights[m] = 1.0 / len(normal)
        return weights, flags

    def state(self) -> list[list[float]]:
        """Every detector's (count, mean, m2), units x workers x 3 (checkpointed)."""
        return [[v for d in unit for v in d.state()] for unit in self.detectors]

    def load(self, table: list[list[float]]) -> None:
        for unit, values in zip(self.detectors, table, strict=True):
            for m, detector in enumerate(unit):
                detector.load(values[3 * m : 3 * m + 3])
