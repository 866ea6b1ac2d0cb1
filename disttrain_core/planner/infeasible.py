"""Why Algorithm 1 found no feasible layout: the binding constraint, named in one line (batch arithmetic, memory
even in the most memory-friendly LLM layout, or devices)."""

from __future__ import annotations

from .evaluate import COLOCATED, UnitChoice


def no_layout_reason(solver) -> str:
    """Name the binding constraint when nothing is feasible."""
    N = solver.m.devices
    per_rank = solver.m.batch // solver.m.micro
    if solver.m.batch % solver.m.micro:
        return (
            f"optim.global_batch_size={solver.m.batch} is not a multiple of optim.micro_batch_size="
            f"{solver.m.micro}: no data-parallel size divides the batch"
        )
    # memory: the most memory-friendly LLM layout with all devices
    tp = max(t for t in solver.tp_options if solver.tp_ok("llm", t))
    cp = max(c for c in solver.cp_options if c == 1 or tp * c <= N)
    pp = max(p for p in solver.llm_pp_options(1) if p * tp * cp <= max(N, tp)) if N >= tp * cp else 1
    probe = solver.m.evaluate(
        UnitChoice(tp, 1, pp, cp=cp),
        COLOCATED if solver.has_enc else None,
        COLOCATED if solver.has_gen else None,
    )
    if not probe.feasible and "GB" in probe.reason:
        return (
            f"memory: even with tp={tp}{f', cp={cp}' if cp > 1 else ''}, pp={pp} the model does not fit "
            f"({probe.reason}); "
            "use more devices, a larger device, a smaller optim.micro_batch_size or planner.recompute=full "
            "(or selective_op, every_k)"
        )
    return (
        f"no layout of {N} devices fits: global batch {solver.m.batch} / micro batch {solver.m.micro} = "
        f"{per_rank} micro-batches, LLM TP options {solver.tp_options}; {probe.reason or 'add devices'}"
    )
