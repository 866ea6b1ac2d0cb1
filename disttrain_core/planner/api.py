"""The planner's functions on a composed config: the layout model of a config's cluster and model (analytic or
profiled costs), the choices a configured layout makes, the memory fit of a model and of every rank role, and
``make_plan`` (the solver and its baselines). planner/__init__.py exports them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .baselines import exhaustive, flops_proportional, megatron
from .breakdown import RoleMemory, unit_roles
from .context_choice import configured_cp_mode
from .costs import CostModel, Hardware, PlannerSettings, planned_devices, planned_precision
from .evaluate import AUDIO_UNITS, COLOCATED, LayoutModel, UnitChoice
from .fill_split import configured_fill_split
from .memory import OFFLOADED
from .options import CP_MIN_TOKENS, CP_OPTIONS
from .schedule_choice import DEFAULT as DEFAULT_SCHEDULES
from .solver import Orchestrator, Plan, PlanningError
from .workload import workload_of


@dataclass
class PlanResult:
    plan: Plan
    model: LayoutModel
    cfg_summary: dict


def _uses_profile(cfg) -> bool:
    choice = cfg.planner.cost
    if choice not in ("auto", "profiled", "analytic"):
        raise PlanningError(f"planner.cost={choice!r}: allowed values are auto, profiled and analytic")
    if choice == "analytic":
        return False
    if choice == "profiled":
        return True
    if cfg.cluster.device == "cpu":
        return True
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 1


def with_measured_links(hw: Hardware, profile, device: str, devices: int) -> Hardware:
    """The preset's links, or those the profile measured where they are the cluster's: on a CPU cluster (this
    machine, gloo over loopback) all of them; on GPUs only the intra-node figures, and only when the profile
    timed GPU tensors over NCCL (a CPU-tensor gloo figure says nothing of NVLink, and one node's profile
    nothing of InfiniBand)."""
    if profile is None or not profile.allreduce_bw:
        return hw
    measured = {"intra_bw": profile.allreduce_bw, "latency_s": profile.latency_s, "p2p_bw": profile.p2p_bw}
    if device == "cpu":
        inter = min(hw.inter_bw, profile.allreduce_bw) if hw.per_node < devices else profile.allreduce_bw
        return Hardware(**{**hw.__dict__, **measured, "inter_bw": inter})
    if getattr(profile, "link_backend", "gloo") != "nccl":
        return hw
    return Hardware(**{**hw.__dict__, "intra_bw": profile.allreduce_bw})


def settings_split(split) -> tuple[int, ...] | str | None:
    """parallel.pp_split as the planner's settings hold it (a tuple of block counts, "auto" or None)."""
    if split is None or isinstance(split, str):
        return split
    return tuple(int(count) for count in split)


def build_layout_model(cfg, devices: int | None = None, progress=print) -> LayoutModel:
    """The planner's cost model for ``cfg`` (profiling this machine when the cost source says so)."""
    devices = devices or planned_devices(cfg)
    work = workload_of(cfg.model)
    precision = planned_precision(cfg)
    settings = PlannerSettings(
        precision=precision,
        recompute=cfg.planner.recompute,
        recompute_every=int(cfg.planner.recompute_every),
        shard=cfg.planner.shard,
        # on a CPU cluster the host is the device: moving state there frees nothing
        offload=bool(cfg.planner.get("offload", False)) and cfg.cluster.device == "cuda",
        schedules=tuple(cfg.planner.get("schedules", DEFAULT_SCHEDULES)),
        dp_overlap=float(cfg.planner.dp_overlap),
        memory_margin=float(cfg.planner.memory_margin),
        pp_split=settings_split(cfg.parallel.get("pp_split")),
        sequence_parallel=bool(cfg.parallel.get("sequence_parallel", True)),
        fill_split=configured_fill_split(cfg),
    )
    profile = None
    peak = None
    data_s_per_sample = 0.0
    if _uses_profile(cfg):
        # On this machine the data is here too: plan for the images, clips and frame groups per sample its encoders
        # really receive, and on a CPU for the preprocessing that shares the cores with training.
        from .workload import measured_data, with_items_per_sample

        measured = measured_data(cfg) if cfg.data.get("path") else None
        if measured is not None:
            work = with_items_per_sample(work, measured[0])
            if cfg.cluster.device == "cpu":
                data_s_per_sample = measured[1]
        from .profiler import _threads, load_or_profile, profiling_processes

        world = profiling_processes(cfg, devices, work, progress)
        if world:
            profile = load_or_profile(cfg, world, list(cfg.planner.tp_options), progress=progress)
        if cfg.cluster.device == "cpu":
            import torch

            from ..train.perf import peak_flops_per_device

            before = torch.get_num_threads()
            torch.set_num_threads(_threads(cfg, devices))
            try:
                peak = peak_flops_per_device(
                    precision, torch.device("cpu"), cfg.cluster.peak_flops_bf16, cfg.cluster.peak_flops_fp32
                )
            finally:
                torch.set_num_threads(before)
    hw = Hardware.from_config(cfg.cluster, precision, peak, tf32=bool(cfg.trainer.tf32))
    hw = with_measured_links(hw, profile, cfg.cluster.device, devices)
    costs = CostModel(work, hw, settings, profile)
    model = LayoutModel(costs, int(cfg.optim.global_batch_size), int(cfg.optim.micro_batch_size), devices)
    if data_s_per_sample:
        from ..config import cpu_count

        model.data_s_per_sample, model.data_cores = data_s_per_sample, cpu_count()
    return model


GB = 1e9


def check_model_fits(cfg, devices: int) -> None:
    """Refuse, before any profiling, a model whose training state cannot fit the planned devices however
    it is split: the weights, gradients and Adam moments in fp32 (16 bytes per trainable parameter, 4 per
    frozen one) spread evenly over every device is the least any layout needs."""
    work = workload_of(cfg.model)
    params = sum(u.params for u in work.units.values())
    state = sum(u.params * (4 + 12 * u.trainable_fraction) for u in work.units.values())
    capacity = devices * float(cfg.cluster.memory_per_device_gb) * GB
    if cfg.cluster.device == "cuda" and cfg.planner.get("offload", False):  # the optimizer may move to the hosts
        nodes = -(-devices // int(cfg.cluster.gpus_per_node))
        capacity += nodes * float(cfg.cluster.get("host_memory_per_node_gb", 2048.0)) * GB
    if state <= capacity * float(cfg.planner.memory_margin):
        return
    gpus = smallest_gpu_cluster(cfg)
    where = (
        f"cluster=h100_80g cluster.num_gpus={gpus}" if gpus else "cluster=h100_80g cluster.num_gpus=<more than 8192>"
    )
    raise PlanningError(
        f"model={cfg.model.name} has {params / 1e9:.1f} B parameters; its training state alone (fp32 weights, "
        f"gradients and Adam moments) is {state / GB:,.0f} GB, more than the {devices} device(s) x "
        f"{cfg.cluster.memory_per_device_gb:g} GB of cluster={cfg.cluster.name} can hold under any layout. "
        f"Plan it for a GPU cluster instead (the smallest power-of-two H100 cluster it fits): "
        f"python train.py model={cfg.model.name} parallel=auto {where} trainer.dry_run=true"
    )


def smallest_gpu_cluster(cfg, preset: str = "h100_80g", largest: int = 8192) -> int | None:
    """The fewest GPUs (a power of two) of a cluster preset for which the analytic planner finds a layout."""
    from omegaconf import OmegaConf

    from ..config import CONF_DIR

    trial = OmegaConf.merge(cfg, {"planner": {"cost": "analytic", "baselines": False}})
    trial.cluster = OmegaConf.merge(trial.cluster, OmegaConf.load(CONF_DIR / "cluster" / f"{preset}.yaml"))
    gpus = 8
    while gpus <= largest:
        trial.cluster.num_gpus = gpus
        try:
            make_plan(trial, progress=lambda *_: None, check_fit=False)
            return gpus
        except PlanningError:
            gpus *= 2
    return None


def runtime_has_ep(cfg) -> bool:
    """Can the configured runtime run expert parallelism (``parallel.units.llm.ep`` exists)? Until it does, a
    plan that trains must keep every expert on every rank."""
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, "parallel.units.llm.ep", default=None) is not None


def make_plan(
    cfg,
    devices: int | None = None,
    progress=print,
    check_fit: bool = True,
    allow_ep: bool | None = None,
    cp_modes: tuple[str, ...] | None = None,
) -> PlanResult:
    """Plan ``cfg``. ``allow_ep``: may the LLM use expert parallelism (None: when the runtime can run it,
    ``runtime_has_ep``; tools/plan.py, which only plans, allows it); ``cp_modes``: the context-parallel modes
    the solver may use (None: every one the heads allow; tools/plan_cp_modes.py plans each alone)."""
    from omegaconf import OmegaConf

    if cfg.optim.global_batch_size % cfg.optim.micro_batch_size:
        raise PlanningError(
            f"optim.global_batch_size={cfg.optim.global_batch_size} is not a multiple of "
            f"optim.micro_batch_size={cfg.optim.micro_batch_size}: no data-parallel size can divide the batch"
        )
    if check_fit:  # before profiling anything
        check_model_fits(cfg, devices or planned_devices(cfg))
    model = build_layout_model(cfg, devices, progress)
    solver = Orchestrator(
        model,
        tp_options=tuple(cfg.planner.tp_options),
        vpp_options=tuple(cfg.planner.vpp_options),
        allow_colocation=bool(cfg.planner.colocation),
        # not config fields (yet): the solver's defaults unless a config carries them
        cp_options=tuple(OmegaConf.select(cfg, "planner.cp_options", default=CP_OPTIONS)),
        min_cp_tokens=int(OmegaConf.select(cfg, "planner.cp_min_tokens", default=CP_MIN_TOKENS)),
        allow_ep=runtime_has_ep(cfg) if allow_ep is None else allow_ep,
        cp_modes=cp_modes,
    )
    if cfg.planner.solver not in ("algorithm1", "exhaustive"):
        raise PlanningError(f"planner.solver={cfg.planner.solver!r}: allowed values are algorithm1 and exhaustive")
    plan = solver.solve() if cfg.planner.solver == "algorithm1" else exhaustive(solver)
    if cfg.planner.baselines:
        for baseline in (megatron(solver), megatron(solver, as_paper=True), flops_proportional(solver)):
            if baseline is not None:
                plan.baselines[baseline.name] = baseline
    summary = {
        "model": cfg.model.name,
        "cluster": cfg.cluster.name,
        "devices": model.devices,
        "global_batch": model.batch,
        "micro_batch": model.micro,
        "precision": model.c.settings.precision,
        "cost_model": model.c.source,
        "profiled": model.c.profiled(),  # unit -> TP sizes timed here; the rest is analytic
        "solver": cfg.planner.solver,
    }
    return PlanResult(plan, model, summary)


def choices_of_config(cfg, layout=None) -> tuple[UnitChoice, UnitChoice | None, UnitChoice | None, dict]:
    """The planner's view of a configured (non-auto) layout: (llm, encoder, generator, the audio units' choices by
    name), as ``LayoutModel.evaluate`` takes them. ``layout``: the run's resolved one; None: ``cfg``'s, resolved
    here (a candidate the planner weighs, a tool's config)."""
    from ..parallel.resolved import config_layout

    layout = layout or config_layout(cfg)
    by_module = {}
    for unit in layout.units:
        for module in unit.modules:
            by_module[module] = unit
    llm_unit = by_module["llm"]
    cp = getattr(llm_unit, "cp", 1)
    cp_mode, cp_ulysses = configured_cp_mode(cfg, llm_unit.tp, cp)  # planner/context_choice.py
    llm = UnitChoice(
        llm_unit.tp,
        llm_unit.dp,
        llm_unit.pp,
        getattr(llm_unit, "vpp", 1),
        cp=cp,
        ep=getattr(llm_unit, "ep", 1),
        cp_mode=cp_mode,
        cp_ulysses=cp_ulysses,
    )

    def side(module: str):
        if cfg.model[module] is None:
            return None
        unit = by_module.get(module)
        if unit is None or unit is llm_unit:
            return COLOCATED
        return UnitChoice(unit.tp, unit.dp, unit.pp)

    audio = {name: side(name) for name in AUDIO_UNITS if cfg.model[name] is not None}
    return llm, side("encoder"), side("generator"), audio


def _configured_model(cfg, layout, settings, hw) -> LayoutModel:
    """The planner's model of a configured layout's workload, batch and world size (analytic costs)."""
    costs = CostModel(workload_of(cfg.model), hw, settings)
    return LayoutModel(costs, int(cfg.optim.global_batch_size), int(cfg.optim.micro_batch_size), layout.world_size)


def config_roles(cfg, layout=None, cp_mode: tuple[str, int] | None = None) -> tuple[list[RoleMemory], dict]:
    """Every rank role of a configured (non-auto) layout with the numbers the planner uses: analytic
    costs (nothing is profiled), ``planner.precision`` (on a CPU cluster: ``trainer.precision``), each
    unit's own shard mode and recompute policy, the configured schedule. Returns (roles, context).
    ``layout``: the run's resolved one; None: ``cfg``'s, resolved here (tools/memory.py); ``cp_mode``: (mode, ranks
    per all-to-all) in place of the configured parallel.cp_mode (``auto_cp_mode`` weighs each)."""
    from ..parallel.resolved import config_layout
    from .memory import optimizer_state_bytes

    layout = layout or config_layout(cfg)
    precision = planned_precision(cfg)
    moments, outer = optimizer_state_bytes(cfg)
    settings = PlannerSettings(
        precision=precision,
        recompute_every=int(cfg.planner.recompute_every),
        moment_bytes=moments,
        outer_bytes=outer,
        pp_split=settings_split(cfg.parallel.get("pp_split")),
        sequence_parallel=bool(cfg.parallel.get("sequence_parallel", True)),
    )
    hw = Hardware.from_config(cfg.cluster, precision, peak_flops=1.0)  # memory only: no time is computed
    model = _configured_model(cfg, layout, settings, hw)
    llm, enc, gen, audio = choices_of_config(cfg, layout)
    if cp_mode is not None:
        llm = replace(llm, cp_mode=cp_mode[0], cp_ulysses=cp_mode[1])
    choices = {"llm": llm, **audio}
    if enc is not None:
        choices["encoder"] = enc
    if gen is not None:
        choices["generator"] = gen
    S = len(layout.rows)
    m = int(cfg.optim.global_batch_size) // (int(cfg.optim.micro_batch_size) * layout.llm.dp)
    schedule = cfg.schedule.name if S > 1 else "none"
    roles = []
    for unit in layout.units:
        shard = unit.shard + (OFFLOADED if getattr(unit, "offload", "none") == "optimizer" else "")
        roles += unit_roles(model, unit.name, choices, S, m, unit.recompute, shard, schedule, unit.hsdp_replicas)
    context = {
        "model": cfg.model.name,
        "precision": model.c.settings.precision,
        "layout": layout.describe(),
        "world_size": layout.world_size,
        "pipeline_stages": S,
        "microbatches": m,
        "schedule": schedule,
        "params": {name: float(w.params) for name, w in model.c.work.units.items()},
    }
    return roles, context


def auto_pp_split(cfg, layout=None) -> tuple[list[int], list[float]]:
    """``parallel.pp_split=auto`` for a configured layout: the LLM's blocks per stage that balance the stages'
    predicted forward+backward seconds per microbatch (planner/stage_split.py), with analytic costs (nothing is
    profiled: the split weighs blocks against the head and the colocated modules, a ratio of FLOPs) and the
    LLM unit's recompute policy. Returns (blocks per stage, predicted seconds per stage; FLOPs where the cluster
    lists no peak)."""
    from ..parallel.resolved import config_layout

    layout = layout or config_layout(cfg)
    precision = planned_precision(cfg)
    settings = PlannerSettings(precision=precision, recompute_every=int(cfg.planner.recompute_every))
    bf16 = precision.startswith("bf16")
    listed = cfg.cluster.peak_flops_bf16 if bf16 else cfg.cluster.peak_flops_fp32
    # A cluster that lists no peak (local_cpu) splits by FLOPs alone: one FLOP per second, links negligible. Not
    # measured here: every node of a job must reach the same split.
    peak = None if listed else 1.0
    hw = Hardware.from_config(cfg.cluster, precision, peak, tf32=bool(cfg.trainer.tf32))
    model = _configured_model(cfg, layout, settings, hw)
    llm, enc, gen, audio = choices_of_config(cfg, layout)
    policy = layout.llm.recompute
    first, last = model.llm_end_extras(llm, enc, gen, model.pp_bw(layout.world_size), policy, audio)
    costs = model.llm_stage_costs(llm, first, last, policy)
    split = costs.best(llm.pp * stages_of(cfg, layout))
    return split, costs.stage_times(split)


def stages_of(cfg, layout) -> int:
    """LLM pipeline stages per pipeline rank (virtual stages) of a configured layout."""
    from ..parallel.plan import stages_per_rank

    return stages_per_rank(cfg) if len(layout.units) == 1 else 1


def annotate_memory_report(cfg, layout, run_dir, rank: int) -> None:
    """Add the planner's prediction for ``cfg``'s resolved ``layout`` (and the layout context) to a rank's
    ``trainer.memory_report_step`` file (train/memory_report.py), beside what the rank counted and measured."""
    import json
    from pathlib import Path

    path = Path(run_dir) / "memory" / f"rank{rank:05d}.json"
    if not path.is_file():
        return
    report = json.loads(path.read_text())
    roles, context = config_roles(cfg, layout)
    role = report["role"]
    stages = sum(1 for r in roles if r.unit == role["unit"])
    match = next(r for r in roles if r.unit == role["unit"] and r.pp == min(role["pp"], stages - 1))
    path.write_text(json.dumps({**report, **context, "predicted": match.as_dict()}, indent=1))


def planned_fill_split(cfg, model: LayoutModel) -> tuple[int, ...]:
    """A ``schedule.fill_split`` for a configured layout with the encoder folded, from the planner's costs (profiled
    where it profiles this machine): the encoder's colocated seconds spread evenly over its blocks, balanced against
    each LLM stage's own seconds (schedule/bubble_fill.py balance_blocks). FLOPs (``fill_split=auto``) weigh every
    module at the same speed; a CPU runs a U-Net's convolutions far slower than a ViT's matmuls."""
    from ..models.vit import vit_block_count
    from ..schedule.bubble_fill import balance_blocks

    llm, enc, gen, audio = choices_of_config(cfg)
    evaluation = model.evaluate(llm, enc, gen, audio)
    encoder_s = model.colocated_time("encoder", llm.tp, model.micro, evaluation.recompute.get("llm"))
    loads = [t for _, t in evaluation.stage_times]
    loads[0] -= encoder_s
    blocks = vit_block_count(cfg.model.encoder)
    return balance_blocks(loads, encoder_s / blocks, blocks)
