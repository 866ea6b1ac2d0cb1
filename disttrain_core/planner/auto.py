"""``parallel=auto`` in train.py: plan, print, then train with the chosen layout (or stop)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from ..parallel.units import UNIT_NAMES
from ..validation import ConfigError
from .api import make_plan, runtime_has_ep
from .memory import split_shard
from .report import plan_dict, plan_table, predicted_timelines
from .solver import PlanningError


def available_devices(cfg) -> tuple[str, int]:
    """(device type, devices this launch can use) given the trainer and the machine."""
    import torch

    if cfg.cluster.device == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return "cuda", count * int(cfg.trainer.num_nodes)
    return "cpu", int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)


def layout_container(plan_evaluation, every: int = 2, with_ep: bool = False) -> dict:
    """The ``parallel`` section that runs a plan through the units runtime. The LLM's ``cp`` is always
    written; its ``ep`` only when the runtime's config has the field (``with_ep``: ``runtime_has_ep``), and
    a plan with ep > 1 is never made without it (make_plan)."""
    choices = plan_evaluation.choices
    units = {}
    for name in UNIT_NAMES:
        choice = choices.get(name)
        if choice is None:
            units[name] = {"dp": 1, "tp": 1, "pp": 1, "vpp": 1, "colocate": name != "llm"}
        elif choice.colocated:
            units[name] = {"dp": 1, "tp": 1, "pp": 1, "vpp": 1, "colocate": True}
        else:
            units[name] = {"dp": choice.dp, "tp": choice.tp, "pp": choice.pp, "vpp": choice.vpp, "colocate": False}
            # the recompute the memory model assumed (colocated modules recompute as the LLM unit does)
            units[name].update(recompute=plan_evaluation.recompute.get(name, "none"), recompute_every=every)
            # what the memory model assumed: the shard mode, and whether the optimizer is on the host
            shard, offloaded = split_shard(plan_evaluation.shard.get(name, "zero1"))
            units[name]["shard"] = shard
            units[name]["offload"] = "optimizer" if offloaded else "none"
            if name == "llm":
                units[name]["cp"] = choice.cp
                if with_ep:
                    units[name]["ep"] = choice.ep
                elif choice.ep > 1:
                    raise ConfigError(f"the plan uses ep={choice.ep} but this runtime has no parallel.units.llm.ep")
    split = list(plan_evaluation.llm_split) or None  # parallel.pp_split=auto: the balanced split it evaluated
    llm = choices.get("llm")
    return {
        "name": "auto",
        "mode": "manual",
        "dp": -1,
        "tp": 1,
        "pp": 1,
        "modality_stages": "separate",
        "units": units,
        "pp_split": split,
        # how the LLM's cp ranks attend: the mode the plan was costed with (parallel.cp_mode)
        "cp_mode": llm.cp_mode if llm is not None and llm.cp > 1 else "ring",
        "cp_ulysses": llm.cp_ulysses if llm is not None and llm.cp_mode == "hybrid" else 0,
    }


def planned_container(cfg, container: dict, result) -> dict:
    """``container`` (the composed config ``cfg`` came from) with the plan's layout and schedule: what the run
    trains, and what the closure test over the planner's plans resolves (tests/unit/test_compositions.py)."""
    planned = copy.deepcopy(container)
    every = result.model.c.settings.recompute_every
    planned["parallel"] = layout_container(result.plan.evaluation, every, runtime_has_ep(cfg))
    evaluation = result.plan.evaluation
    vpp = planned["parallel"]["units"]["llm"]["vpp"]  # the LLM's stages per rank (a loop or a V)
    name = evaluation.schedule if len(evaluation.stage_times) > 1 else "none"
    planned["schedule"] = {**planned["schedule"], "name": name, "vpp": vpp}
    return planned


def resolve_auto(cfg, container: dict, run_dir: Path) -> dict | None:
    """Plan ``cfg``; return the container to train with, or None after a dry run."""
    try:
        result = make_plan(cfg)
    except PlanningError as error:
        raise ConfigError(f"parallel=auto found no feasible layout: {error}") from error
    except ValueError as error:  # a setting the cost model cannot use (a cluster without its peak FLOPs)
        raise ConfigError(f"parallel=auto: {error}") from None
    print(plan_table(result), flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    details = plan_dict(result)
    (run_dir / "plan.json").write_text(json.dumps(details, indent=1))
    try:
        predicted_timelines(result, run_dir / "plan.png")
    except Exception as error:  # a picture must never stop a run
        print(f"(no plan picture: {error})")
    planned = planned_container(cfg, container, result)
    if cfg.trainer.dry_run:
        print(f"dry run: plan written to {run_dir / 'plan.json'}; rehearsing each rank role on the meta device")
        from ..config import typed_config
        from .rehearsal import rehearse

        rehearse(typed_config(planned), run_dir)
        print(f"rehearsal written to {run_dir / 'rehearsal.json'}")
        return None
    needed = result.plan.evaluation.gpus
    kind, have = available_devices(cfg)
    if kind == "cuda" and have < needed:
        raise ConfigError(
            f"the plan needs {needed} CUDA devices but this launch sees {have} "
            f"({cfg.trainer.num_nodes} node(s)); run it on the cluster with trainer.devices="
            f"{cfg.cluster.gpus_per_node} trainer.num_nodes={-(-needed // cfg.cluster.gpus_per_node)}, "
            "or add trainer.dry_run=true to only plan"
        )
    out = planned
    if kind == "cpu":
        nodes = int(cfg.trainer.num_nodes)
        if needed % nodes:
            raise ConfigError(f"the plan uses {needed} processes, which {nodes} nodes cannot share evenly")
        if needed != have:
            print(f"the plan uses {needed} of the {have} processes requested: starting {needed}")
        out["trainer"]["devices"] = needed // nodes
    else:
        out["trainer"]["precision"] = result.model.c.settings.precision  # train in what was planned
        out["trainer"]["devices"] = min(int(cfg.cluster.gpus_per_node), needed)
        out["trainer"]["num_nodes"] = -(-needed // out["trainer"]["devices"])
    return out


def auto_cp_mode(cfg, layout) -> tuple[str, int, dict[str, tuple[float, float]]]:
    """``parallel.cp_mode=auto`` for a configured layout: of the modes the LLM's heads allow
    (planner/options.py ``cp_mode_candidates``), the one with the least predicted LLM rank time per microbatch
    (compute plus exposed context-parallel communication, analytic costs of the cluster; a cluster listing no
    peak counts compute as free, so the least communication wins) among those whose fullest LLM rank fits the
    cluster's device memory (all of them when none does). Returns (mode, ranks per all-to-all,
    {label: (seconds, peak bytes)}); analytic so that every node reaches the same choice."""
    from .api import _configured_model, config_roles
    from .costs import Hardware, PlannerSettings, planned_precision
    from .options import cp_mode_candidates

    unit = layout.llm
    precision = planned_precision(cfg)
    bf16 = precision.startswith("bf16")
    listed = cfg.cluster.peak_flops_bf16 if bf16 else cfg.cluster.peak_flops_fp32
    hw = Hardware.from_config(cfg.cluster, precision, None if listed else float("inf"), tf32=bool(cfg.trainer.tf32))
    settings = PlannerSettings(precision=precision, recompute_every=int(cfg.planner.recompute_every))
    model = _configured_model(cfg, layout, settings, hw)
    llm = cfg.model.llm
    candidates = cp_mode_candidates(unit.cp, unit.tp, llm.n_heads, llm.n_kv_heads, hw.per_node)
    found = {}
    for mode, ulysses in candidates:
        seconds = model.c.rank_compute("llm", unit.tp, model.micro, unit.cp, unit.ep, mode, ulysses)
        roles, _ = config_roles(cfg, layout, (mode, ulysses))
        peak = max(role.total for role in roles if role.unit == unit.name)
        found[mode if mode != "hybrid" else f"hybrid(u={ulysses})"] = (seconds, peak, mode, ulysses)
    fitting = [entry for entry in found.values() if entry[1] <= hw.memory_bytes] or list(found.values())
    _, _, mode, ulysses = min(fitting, key=lambda entry: entry[0])
    return mode, ulysses, {label: entry[:2] for label, entry in found.items()}
