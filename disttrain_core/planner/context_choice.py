"""How a configured LLM's context-parallel ranks attend (parallel.cp_mode) as the planner's choice. ``auto`` is
resolved at launch (planner/auto.py ``auto_cp_mode``); the solver weighs the modes itself (planner/options.py
``cp_mode_candidates``); their costs: planner/parallel_costs.py."""

from __future__ import annotations


def configured_cp_mode(cfg, tp: int, cp: int) -> tuple[str, int]:
    """(parallel.cp_mode, ranks per all-to-all) of a configured LLM at ``tp`` x ``cp``; ``auto`` not yet resolved
    (or a mode its heads do not allow, which validation refuses) counts as the ring."""
    from ..comm.context_modes import ulysses_degree

    mode = cfg.parallel.get("cp_mode", "ring")
    if cp <= 1 or mode == "auto":
        return "ring", 1
    llm = cfg.model.llm
    try:
        return mode, ulysses_degree(
            mode, cp, int(cfg.parallel.get("cp_ulysses", 0)), llm.n_heads // tp, max(1, llm.n_kv_heads // tp)
        )
    except ValueError:
        return "ring", 1
