"""The encoder's blocks per chunk a configured run with schedule.fill_bubbles uses (parallel/bubble_plan.py), which
``LayoutModel`` prices (planner/evaluate.py); planner/api.py ``planned_fill_split`` proposes one from its costs."""

from __future__ import annotations


def configured_fill_split(cfg) -> tuple[int, ...] | None:
    """The encoder's blocks per chunk the run would use (None: no bubble filling, or no pipeline to fill)."""
    if not cfg.schedule.get("fill_bubbles", False) or cfg.model.encoder is None:
        return None
    from ..parallel.bubble_plan import encoder_split
    from ..parallel.plan import units_of

    try:  # parallel=auto has nothing placed yet; a bad fill_split is validation's to name (validation/bubble_fill.py)
        pp = units_of(cfg).llm.pp
        return encoder_split(cfg, pp) if pp > 1 else None
    except (ValueError, TypeError):
        return None
