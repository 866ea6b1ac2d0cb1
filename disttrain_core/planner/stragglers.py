"""The straggler model of data skew (issue 19): what uneven images per sample cost a layout at scale.

The planner (planner/evaluate.py) prices every microbatch at the *mean* number of images per sample. Real
interleaved data is skewed: one sample carries one image, the next fifteen. Here the skew is sampled, not
averaged:

1. **Images per sample** come from a discrete law per workload preset (``law_of``): a preset with a fixed
   count (one image per pair, a fixed tile grid, one input and one generated image) has no skew; a preset
   marked ``skewed`` (planner/presets.py) draws its count from a *truncated geometric* law on 1 .. ``most``,
   ``P(n) ~ r^(n-1)``, the shape of the repository's LAION-like synthetic data (data/synthetic.py and
   docs/DATA.md: geometric with p = 0.45 truncated at 8; tools/bench_reorder.py ``laion_like_costs``), with
   the ratio ``r`` solved so that the law's mean is the preset's ``images_per_sample`` exactly, and ``most``
   the largest count whose patches fit the model's sequence (a sample the LLM's fixed-length sequence
   cannot hold does not exist in this workload). Samples with no image (5% of the synthetic data) are left
   out: the presets' means are per image-bearing document.
2. **Global batches**: ``batches`` seeded draws of ``m x B`` samples (``m`` microbatch slots of
   ``B = micro_batch x dp_llm`` samples, as the evaluation counts them), laid out in *arrival order*
   (data-parallel replica ``d`` of a unit with ``dp`` replicas takes the contiguous block ``d`` of every
   slot, as the broker hands them) or by the repository's reordering (data/reorder.py ``arrange``: Algorithm
   2 across the canonical grid of every unit's DP size, then Algorithm 3's slot order for 1F1B on the
   pipeline's stage count, called as the producer calls it, data/producer_server.py). A sample's cost for
   the reordering is its image count: the only work that varies per sample here (the LLM's sequences have a
   fixed length; the generator makes 0 or 1 image for every sample of a preset, so its stage never varies).
3. **Stage times per (LLM DP rank, microbatch)**: the evaluation's per-stage times at the mean
   (``Evaluation.stage_times``), with the encoder's part scaled by ``load / mean load`` of the encoder
   replica(s) the LLM rank's samples come from: the whole separate encoder stage (its compute and its
   boundary transfer both grow with the images), or, folded into the first LLM stage, the colocated encoder
   time (``LayoutModel.colocated_time``). In the rigid layout the encoder replicas are the LLM's DP ranks
   (or its DP x CP ranks); in a disaggregated plan the encoder unit has its own DP size: an encoder replica
   serving several LLM ranks carries all their images, and an LLM rank fed by several encoder replicas
   waits for the slowest (the encoder's own 1F1B and its backward coupling to several LLM ranks are not
   modelled).
4. Each LLM rank's microbatches run through the schedule simulator (schedule/simulator.py, 1F1B on the
   pipeline's stages; forward 1/3, backward 2/3 of a stage's time, as data/reorder.py times them; virtual
   stages are not interleaved here); the iteration is the slowest DP rank's makespan (they meet at the
   gradient synchronization) plus the evaluation's tail (sync, optimizer, data). Only ``CANDIDATES`` ranks
   are simulated (ranks can number in the hundreds): the slowest by a cheap estimate of the makespan, and
   the one with the most images (``candidate_ranks``), so the maximum over ranks may miss a rank that the
   estimate ranks lower.

5. **Rebalanced** (``rebalance``; parallel.rebalance_items, comm/item_balance.py): the encoder's replicas share
   each slot's items evenly, so every LLM rank waits for ``ceil(items / replicas)`` images, plus the exchange of the
   busiest sender or receiver (``Pipeline.exchange_s_per_item``: an embedding forward and its gradient back over the
   encoder's DP links; the pixels sent are left out, a few percent of an embedding's bytes).

The **straggler factor** is the mean over the sampled batches of that iteration time over the iteration
time with every microbatch at the mean; the layout's straggler-adjusted iteration time is the evaluation's
``iteration_s`` times it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..data.reorder import arrange, canonical_groups
from ..schedule.actions import Kind
from ..schedule.generators import build_schedule
from ..schedule.simulator import simulate
from .evaluate import Evaluation, LayoutModel

BATCHES = 8  # sampled global batches per layout (each a few thousand samples)
SEED = 0
CANDIDATES = 4  # LLM DP ranks simulated per batch: the 3 slowest by an estimate, and the most loaded


@dataclass(frozen=True)
class ImageCountLaw:
    """A discrete law of images per sample: ``counts[i]`` with probability ``probabilities[i]``."""

    counts: tuple[int, ...]
    probabilities: tuple[float, ...]
    name: str = ""

    @property
    def mean(self) -> float:
        return float(np.dot(self.counts, self.probabilities))

    @property
    def skewed(self) -> bool:
        return sum(p > 0 for p in self.probabilities) > 1

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return rng.choice(np.asarray(self.counts, dtype=np.int64), size=size, p=np.asarray(self.probabilities))


def fixed_law(count: int) -> ImageCountLaw:
    return ImageCountLaw((int(count),), (1.0,), f"fixed {count}")


def truncated_geometric_law(mean: float, most: int) -> ImageCountLaw:
    """``P(n) ~ r^(n-1)`` on ``1 .. most`` with ``r`` solved (bisection on ``log r``) for ``mean``."""
    if not 1.0 < mean < most:
        raise ValueError(f"a truncated geometric law on 1..{most} cannot have mean {mean}")
    counts = np.arange(1, most + 1)

    def law(log_ratio: float) -> np.ndarray:
        weights = np.exp(log_ratio * (counts - 1) - max(0.0, log_ratio) * (most - 1))
        return weights / weights.sum()

    low, high = -30.0, 30.0
    for _ in range(200):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if float(np.dot(counts, law(middle))) < mean else (low, middle)
    probabilities = law(0.5 * (low + high))
    return ImageCountLaw(
        tuple(int(c) for c in counts),
        tuple(float(p) for p in probabilities),
        f"truncated geometric on 1..{most}, ratio {math.exp(0.5 * (low + high)):.3f}, mean {mean:g}",
    )


def synthetic_law(cfg) -> ImageCountLaw:
    """Images per sample of the embedded generator's shards (data/synthetic.py; ``cfg``: data.synthetic): 0 with
    probability text_only_fraction, else geometric with images_geometric_p on 1.. truncated at max_images."""
    p, most, none = float(cfg.images_geometric_p), int(cfg.max_images), float(cfg.text_only_fraction)
    geometric = [(1 - p) ** (n - 1) * p for n in range(1, most)] + [(1 - p) ** (most - 1)]
    counts = (0, *range(1, most + 1))
    probabilities = (none, *((1 - none) * q for q in geometric))
    return ImageCountLaw(counts, probabilities, f"synthetic: {none:g} none, geometric p={p:g} on 1..{most}")


def most_images(preset, seq_len: int, patch_size: int) -> int:
    """The most images of ``preset`` whose patches (every tile's) fit a sequence of ``seq_len`` tokens."""
    patches = (preset.encoder_px // patch_size) ** 2 * preset.tiles
    return max(1, seq_len // patches)


def law_of(preset, seq_len: int = 4096, patch_size: int = 14) -> ImageCountLaw:
    """Images per sample of a workload preset (planner/presets.py); see the module docstring."""
    if not preset.skewed:
        if preset.images_per_sample != int(preset.images_per_sample):
            raise ValueError(f"preset {preset.name} has a fixed count of {preset.images_per_sample} images")
        return fixed_law(int(preset.images_per_sample))
    return truncated_geometric_law(preset.images_per_sample, most_images(preset, seq_len, patch_size))


# ----------------------------------------------------------------------------------------------- the layout
@dataclass(frozen=True)
class Pipeline:
    """One layout as the straggler model sees it (``pipeline_of`` builds it from an evaluation)."""

    stage_seconds: tuple[float, ...]  # forward + backward per microbatch of each stage, at the mean load
    varying: tuple[float, ...]  # the part of each stage's time that scales with its encoder replica's images
    tail_s: float  # iteration time after the pipeline drains (gradient sync, optimizer, data)
    microbatches: int
    samples_per_slot: int  # B
    llm_dp: int
    encoder_dp: int  # replicas sharing a slot's samples for the encoder work
    unit_dps: tuple[int, ...]  # the DP size of every unit with its own devices (the reordering grid)
    # parallel.rebalance_items: seconds one moved item adds on the busiest replica (its embedding sent back in the
    # forward, its gradient out in the backward, over the encoder's data-parallel links)
    exchange_s_per_item: float = 0.0

    @property
    def stages(self) -> int:
        return len(self.stage_seconds)


def pipeline_of(model: LayoutModel, evaluation: Evaluation) -> Pipeline:
    """The stage times, encoder replicas and tail of an evaluated layout (planner/evaluate.py)."""
    choices = evaluation.choices
    llm, encoder = choices["llm"], choices.get("encoder")
    names = [name for name, _ in evaluation.stage_times]
    seconds = [t for _, t in evaluation.stage_times]
    varying = [0.0] * len(seconds)
    encoder_dp = llm.dp
    if encoder is not None and model.images(1.0) > 0:
        if encoder.colocated:  # folded into the first LLM stage: only that stage's encoder share varies
            policy = evaluation.recompute.get("llm")
            varying[names.index("llm")] = model.colocated_time("encoder", llm.tp, model.micro, policy)
        else:
            varying = [t if name == "encoder" else 0.0 for name, t in zip(names, seconds, strict=True)]
            encoder_dp = encoder.dp
    m = evaluation.microbatches
    # The simulator runs plain 1F1B over the stages; with virtual LLM stages (vpp > 1) the shorter fill of
    # interleaving enters the tail as a constant credit (the evaluation's sum of T_s / vpp against the sum of T_s),
    # so the mean-load simulation still reproduces the evaluation and stragglers scale the same stage times.
    tail = evaluation.iteration_s - sum(seconds) - (m - 1) * max(seconds)
    dps = tuple(sorted({ch.dp for ch in choices.values() if not ch.colocated}))
    exchange = 0.0
    if encoder is not None and model.images(1.0) > 0:
        per_item = model.c.boundary_bytes("encoder", 1.0) / model.w.units["encoder"].items_per_sample
        span = encoder_dp * (llm.tp if encoder.colocated else encoder.tp)
        exchange = 2.0 * per_item / model.c.link_bw(span)
    return Pipeline(tuple(seconds), tuple(varying), tail, m, model.micro * llm.dp, llm.dp, encoder_dp, dps, exchange)


# ------------------------------------------------------------------------------------------ batches, orders
@lru_cache(maxsize=64)
def sampled_counts(law: ImageCountLaw, samples: int, batches: int = BATCHES, seed: int = SEED) -> tuple:
    """``batches`` seeded global batches of ``samples`` image counts (the same batches for every layout)."""
    return tuple(law.sample(np.random.default_rng([seed, k]), samples) for k in range(batches))


@lru_cache(maxsize=256)
def arranged_batches(
    law: ImageCountLaw,
    microbatches: int,
    per_slot: int,
    groups: int,
    stages: int,
    reorder: bool,
    batches: int = BATCHES,
    seed: int = SEED,
) -> tuple:
    """Each sampled batch as an ``(m, B)`` table of image counts, slot by slot: in arrival order, or reordered
    by data/reorder.py ``arrange`` (Algorithm 2 over ``groups`` grid groups, Algorithm 3 for ``stages``)."""
    tables = []
    for counts in sampled_counts(law, microbatches * per_slot, batches, seed):
        if reorder:
            order = arrange(counts.astype(float).tolist(), microbatches, per_slot, groups, stages)
            counts = counts[np.asarray(order)]
        tables.append(counts.reshape(microbatches, per_slot))
    return tuple(tables)


def batches_for(pipeline: Pipeline, law: ImageCountLaw, reorder: bool, batches: int = BATCHES, seed: int = SEED):
    """``arranged_batches`` for a layout: the reordering grid is the lcm of its units' DP sizes (the LLM's
    replicas alone if that does not divide a slot); cached across layouts that share the shape."""
    m, per_slot = pipeline.microbatches, pipeline.samples_per_slot
    if not reorder:
        return arranged_batches(law, m, per_slot, 0, 0, False, batches, seed)
    try:
        groups = canonical_groups(pipeline.unit_dps, per_slot)
    except ValueError:
        groups = pipeline.llm_dp
    return arranged_batches(law, m, per_slot, groups, pipeline.stages, True, batches, seed)


# ---------------------------------------------------------------------------------------- iteration times
def load_scales(pipeline: Pipeline, images: np.ndarray, mean_images: float, rebalance: bool = False) -> np.ndarray:
    """``(dp_llm, m)``: each LLM rank's encoder time per slot over its time at the mean load -- the slowest
    of the encoder replicas holding its samples (their loads over the mean load of a replica). Rebalanced
    (parallel.rebalance_items, comm/item_balance.py): every replica encodes ``ceil(slot's items / replicas)``
    at most, and the busiest sender or receiver's exchange is added; every LLM rank then waits the same."""
    m, per_slot = images.shape
    enc_dp, llm_dp = pipeline.encoder_dp, pipeline.llm_dp
    held = images.reshape(m, enc_dp, per_slot // enc_dp).sum(axis=2)
    mean_load = mean_images * (per_slot // enc_dp)
    if rebalance:
        most = -(-held.sum(axis=1) // enc_dp)  # ceil: the fullest replica after balancing
        moved = np.abs(held - held.sum(axis=1, keepdims=True) / enc_dp).max(axis=1)
        exchange = moved * pipeline.exchange_s_per_item / max(pipeline.varying)
        return np.broadcast_to(most / mean_load + exchange, (llm_dp, m)).copy()
    loads = held / mean_load
    scales = np.empty((llm_dp, m))
    for d in range(llm_dp):
        first = d * per_slot // llm_dp
        last = (d + 1) * per_slot // llm_dp - 1
        holders = slice(first * enc_dp // per_slot, last * enc_dp // per_slot + 1)
        scales[d] = loads[:, holders].max(axis=1)
    return scales


def stage_table(pipeline: Pipeline, scales: np.ndarray) -> np.ndarray:
    """``(ranks, stages, m)`` seconds of each stage for each microbatch, given ``load_scales`` rows."""
    base = np.asarray(pipeline.stage_seconds)[None, :, None]
    varying = np.asarray(pipeline.varying)[None, :, None]
    return base + varying * (scales[:, None, :] - 1.0)


@lru_cache(maxsize=32)
def _schedule(stages: int, microbatches: int):
    return build_schedule("1f1b", stages, microbatches)


def simulated_makespan(seconds: np.ndarray) -> float:
    """1F1B makespan of one pipeline from the schedule simulator: ``seconds[s, k]`` per stage and microbatch."""
    stages, m = seconds.shape
    table = seconds.tolist()

    def duration(action) -> float:
        t = table[action.stage][action.microbatch]
        return t / 3 if action.kind == Kind.F else 2 * t / 3

    return simulate(_schedule(stages, m), duration).makespan


def candidate_ranks(times: np.ndarray, scales: np.ndarray, count: int = CANDIDATES) -> list[int]:
    """The LLM ranks worth simulating: the slowest by an estimate of the 1F1B makespan, then the one with the
    most images. The estimate is the larger of the evaluation's formula per slot (slot 0 through every stage,
    then each later slot's slowest stage) and, for each stage, its busy time plus the forward of the first
    microbatch through the stages before it and the backward of the last microbatch back through them."""
    per_slot = times[:, :, 0].sum(axis=1) + times[:, :, 1:].max(axis=1).sum(axis=1)
    fill = np.cumsum(times[:, :, 0] / 3, axis=1) - times[:, :, 0] / 3
    drain = np.cumsum(2 * times[:, :, -1] / 3, axis=1) - 2 * times[:, :, -1] / 3
    per_stage = (fill + times.sum(axis=2) + drain).max(axis=1)
    estimate = np.maximum(per_slot, per_stage)
    ranked = [int(d) for d in np.argsort(-estimate, kind="stable")[: max(1, count - 1)]]
    heaviest = int(np.argmax(scales.sum(axis=1)))
    return ranked + ([heaviest] if heaviest not in ranked else [])


def sampled_iteration(pipeline: Pipeline, images: np.ndarray, mean_images: float, rebalance: bool = False) -> float:
    """Seconds of one iteration on the ``(m, B)`` batch ``images``: the slowest LLM rank's simulated
    makespan plus the tail."""
    scales = load_scales(pipeline, images, mean_images, rebalance)
    times = stage_table(pipeline, scales)
    slowest = max(simulated_makespan(times[d]) for d in candidate_ranks(times, scales))
    return slowest + pipeline.tail_s


def mean_iteration(pipeline: Pipeline) -> float:
    """Seconds of one iteration with every microbatch at the mean load (simulated, plus the tail)."""
    seconds = np.repeat(np.asarray(pipeline.stage_seconds)[:, None], pipeline.microbatches, axis=1)
    return simulated_makespan(seconds) + pipeline.tail_s


@dataclass(frozen=True)
class StragglerResult:
    factor: float  # mean over batches of sampled / mean-load iteration time
    factors: tuple[float, ...]
    mean_iteration_s: float  # simulated, every microbatch at the mean
    reorder: bool
    rebalance: bool = False

    def as_dict(self) -> dict:
        return {
            "factor": self.factor,
            "worst_batch": max(self.factors),
            "batches": len(self.factors),
            "reordered": self.reorder,
            "rebalanced": self.rebalance,
        }


@lru_cache(maxsize=512)
def straggler_factor(
    pipeline: Pipeline,
    law: ImageCountLaw,
    reorder: bool,
    batches: int = BATCHES,
    seed: int = SEED,
    rebalance: bool = False,
) -> StragglerResult:
    """The expected straggler factor of a layout under ``law`` (see the module docstring), its batches reordered
    or not, its encoders' items rebalanced or not; cached, since the plan and the rigid layout are often the same
    layout."""
    if not law.skewed or not any(pipeline.varying):  # every microbatch at the mean: nothing to simulate
        return StragglerResult(1.0, (1.0,) * batches, float("nan"), reorder, rebalance)
    reference = mean_iteration(pipeline)
    factors = tuple(
        sampled_iteration(pipeline, table, law.mean, rebalance) / reference
        for table in batches_for(pipeline, law, reorder, batches, seed)
    )
    return StragglerResult(float(np.mean(factors)), factors, reference, reorder, rebalance)
