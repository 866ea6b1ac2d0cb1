"""``schedule.fill_bubbles``: the colocated image encoder spread over the LLM pipeline's ranks, one chunk of its
blocks per rank, its actions in the pipeline's bubbles (schedule/bubble_fill.py).

The layout stays one unit (the LLM's, holding the encoder's modules); only the schedule, the broker's view of
the first ``P`` stages and the stage modules change. The encoder's chunks are a unit of their own to the broker
(``encoder_unit``): the LLM unit's sizes and ranks, with rows counted per image, so a rank's images and their
embeddings stay with the replica that owns their samples, as between separate units.

The list scheduler orders actions by their cost. Every rank builds the same schedule from the config alone:
per stage, FLOPs per sample from the model (models/flops.py; ``model.nominal_images_per_sample`` images),
the encoder's over its chunks by their blocks (``schedule.fill_split``: even, given, or balanced; the stem on the
first, the head and projector on the last counted with the blocks), the LLM's over its stages
(``parallel.pp_split`` where set), and the rest of the model (generators) on the LLM's last stage.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import Config
from ..models.flops import module_flops
from ..models.vit import vit_block_count
from ..schedule.bubble_fill import StageDurations, balance_blocks, fill_bubbles
from .units import ENCODER_MODULES, ParallelismUnit

ENCODER_COUNTED = ("encoder", "encoder_projector")


def encoder_unit(llm: ParallelismUnit) -> ParallelismUnit:
    """The encoder's chunks as the broker sees them: the LLM unit's places, the encoder's modules and name."""
    return replace(llm, name="encoder", modules=ENCODER_MODULES)


def forward_only_chunks(model, chunks: int) -> int:
    """Leading encoder chunks with nothing to train: every chunk holds encoder blocks, the last also the
    projector; none when the encoder trains."""
    if not model.freeze.encoder:
        return 0
    return chunks if model.freeze.encoder_projector else chunks - 1


def stage_durations(cfg: Config, ranks: int, split: tuple[int, ...] | None = None) -> StageDurations:
    """Relative forward and backward cost per stage of the filled schedule (encoder chunks, then LLM stages);
    ``split``: the encoder's blocks per chunk (None: even)."""
    per_module = module_flops(cfg.model)
    amount = {"image": cfg.model.nominal_images_per_sample, "sequence": 1.0, "sample": 1.0}
    forward = {name: f.forward * amount.get(f.unit, 1.0) for name, f in per_module.items()}
    backward = {name: (f.train - f.forward) * amount.get(f.unit, 1.0) for name, f in per_module.items()}
    shares = [n / sum(split) for n in split] if split else [1.0 / ranks] * ranks

    def per_stage(costs: dict) -> list[float]:
        encoder = sum(costs.get(name, 0.0) for name in ENCODER_COUNTED)
        llm = [costs.get("llm", 0.0) * share for share in _llm_shares(cfg, ranks)]
        llm[-1] += sum(value for name, value in costs.items() if name not in (*ENCODER_COUNTED, "llm"))
        return [encoder * share for share in shares] + llm

    return StageDurations(per_stage(forward), per_stage(backward))


def encoder_split(cfg: Config, ranks: int) -> tuple[int, ...]:
    """The encoder's blocks per chunk: ``schedule.fill_split`` as given, even where null, or for ``auto`` each
    block in turn to the rank whose chunk plus LLM stage costs least so far (forward + backward FLOPs)."""
    blocks, wanted = vit_block_count(cfg.model.encoder), cfg.schedule.fill_split
    if wanted is None:
        return (blocks // ranks,) * ranks
    if not isinstance(wanted, str):
        return tuple(int(n) for n in wanted)
    if wanted != "auto":
        raise ValueError(f"schedule.fill_split={wanted!r}: use auto, null, or blocks per rank, e.g. [10, 6]")
    even = stage_durations(cfg, ranks)
    loads = [even.forward[ranks + r] + even.backward[ranks + r] for r in range(ranks)]
    return balance_blocks(loads, sum(even.forward[r] + even.backward[r] for r in range(ranks)) / blocks, blocks)


def _llm_shares(cfg: Config, ranks: int) -> list[float]:
    split = cfg.parallel.pp_split
    if isinstance(split, (list, tuple)) or (split is not None and not isinstance(split, str)):
        counts = [float(n) for n in split]
        return [n / sum(counts) for n in counts]
    return [1.0 / ranks] * ranks


def filled_schedule(cfg: Config, rows: int, microbatches: int):
    """The run's schedule: ``schedule.name`` over the LLM's ``rows`` with the encoder's chunks in its bubbles."""
    from ..schedule.generators import build_schedule

    base = build_schedule(cfg.schedule.name, rows, microbatches)
    split = encoder_split(cfg, rows)
    durations = stage_durations(cfg, rows, split)
    schedule = fill_bubbles(base, durations, forward_only=forward_only_chunks(cfg.model, rows))
    schedule.meta["encoder_split"] = split
    return schedule
