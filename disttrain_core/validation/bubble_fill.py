"""schedule.fill_bubbles against the model, the layout and the schedule (parallel/bubble_plan.py)."""

from __future__ import annotations

from ..config import Config
from ..models.vit import vit_block_count
from ..schedule.bubble_fill import FILLABLE
from ..schedule.generators import SPLIT_BACKWARD
from .common import _require

KEY = "schedule.fill_bubbles=true"
# Pipeline ranks x microbatches the list scheduler orders before launch (and every rank again at start): about
# 10 s at pp 16 x 512 microbatches on this machine (schedule/bubble_fill.py)
MAX_FILL_SLOTS = 8192


def check_bubble_fill(cfg: Config, layout) -> None:
    """The image encoder rides in the LLM unit, the only unit, over a pipeline of one stage per rank with
    bubbles; its blocks split evenly over the ranks."""
    model, p, s = cfg.model, cfg.parallel, cfg.schedule
    _require(
        model.encoder is not None,
        f"{KEY}: model {model.name} has no image encoder (model.encoder) to spread over the pipeline; set "
        "schedule.fill_bubbles=false",
    )
    towers = [name for name in ("audio_encoder", "video_encoder") if getattr(model, name) is not None]
    _require(
        not towers,
        f"{KEY}: bubble filling spreads the image encoder only, and model {model.name} also has "
        f"{', '.join(towers)} on the LLM's first stage; set schedule.fill_bubbles=false",
    )
    units = ", ".join(unit.name for unit in layout.units)
    _require(
        len(layout.units) == 1 and "encoder" in layout.units[0].modules,
        f"{KEY}: the layout has units {units}; bubble filling needs every module in the LLM unit "
        "(parallel.mode=megatron with parallel.modality_stages=folded, or manual with colocate=true)",
    )
    llm = layout.llm
    _require(
        llm.pp >= 2,
        f"{KEY}: a pipeline of one stage (pp=1) has no bubbles to fill; set parallel.pp>=2 or "
        "schedule.fill_bubbles=false",
    )
    why = "a zero-bubble schedule" if s.name in SPLIT_BACKWARD else "it places several stages per rank"
    _require(
        s.csv is None and s.name in FILLABLE,
        f"{KEY}: schedule={s.csv or s.name} has no bubbles to fill this way ({why}); use schedule=1f1b or "
        "schedule=gpipe, or set schedule.fill_bubbles=false",
    )
    _check_split(s.fill_split, vit_block_count(model.encoder), llm.pp)
    micro = cfg.optim.global_batch_size // max(cfg.optim.micro_batch_size * llm.dp, 1)
    _require(
        micro * llm.pp <= MAX_FILL_SLOTS,
        f"{KEY}: {micro} microbatches per step x pp={llm.pp} = {micro * llm.pp} slots to list-schedule before launch "
        f"(at most {MAX_FILL_SLOTS}); raise optim.micro_batch_size or lower optim.global_batch_size",
    )
    _require(llm.cp == 1, f"{KEY} with cp={llm.cp}: the encoder's chunks do not split sequences; set parallel.cp=1")
    _require(
        not p.rebalance_items,
        f"{KEY} with parallel.rebalance_items=true: rebalancing moves a whole encoder's items, and here the encoder "
        "is split over the pipeline; set one of them false",
    )
    _require(
        not isinstance(p.pp_split, str),
        f"{KEY} with parallel.pp_split={p.pp_split}: auto balances the encoder on the first stage, which bubble "
        "filling spreads over every rank; give the LLM blocks per stage or leave it unset",
    )


def _check_split(split, blocks: int, pp: int) -> None:
    """schedule.fill_split: null (even: pp divides the blocks), auto, or one block count per pipeline rank."""
    if split is None:
        _require(
            blocks % pp == 0,
            f"{KEY}: the image encoder builds {blocks} blocks, which do not split evenly into pp={pp} chunks; "
            "choose a pipeline size dividing them, or give schedule.fill_split (blocks per rank, or auto)",
        )
        return
    if isinstance(split, str):
        _require(split == "auto", f"schedule.fill_split={split!r}: use auto, null, or blocks per rank, e.g. [10, 6]")
        return
    counts = list(split) if not isinstance(split, (bool, int, float)) else None
    _require(
        counts is not None and all(isinstance(n, int) and not isinstance(n, bool) for n in counts),
        f"schedule.fill_split={split!r}: give whole block counts, one per pipeline rank, e.g. [10, 6]",
    )
    _require(
        len(counts) == pp and min(counts) >= 1 and sum(counts) == blocks,
        f"schedule.fill_split={counts}: give {pp} counts (one per pipeline rank), each at least 1, adding up to "
        f"the image encoder's {blocks} blocks",
    )


def check_fill_split_alone(cfg: Config) -> None:
    """schedule.fill_split without schedule.fill_bubbles would be silently ignored."""
    _require(
        cfg.schedule.fill_split is None,
        f"schedule.fill_split={cfg.schedule.fill_split} splits the encoder for bubble filling, which is off; set "
        "schedule.fill_bubbles=true or unset schedule.fill_split",
    )


def check_fill_mode(cfg: Config) -> None:
    """Before any layout is resolved (the planner has not run): bubble filling runs in a configured layout."""
    mode = cfg.parallel.mode
    _require(
        not cfg.schedule.fill_bubbles or mode in ("megatron", "manual"),
        f"{KEY} with parallel.mode={mode}: bubble filling is built for a configured colocated layout (the planner "
        "does not place encoder chunks); use parallel=pp2 or parallel=pp4 (the encoder folded into the first stage)",
    )
