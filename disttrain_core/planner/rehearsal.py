"""The rehearsal (``trainer.dry_run=true``): every distinct rank role of a layout -- (unit, pipeline
stage); its DP replicas and TP ranks hold the same amounts -- built with the runtime's own code on the
meta device, its model-state bytes counted, beside the planner's prediction for that role.

Each role is built inside a *fake* process group (``torch.testing._internal.distributed.fake_pg``:
collectives that do nothing) of the role's dp x tp ranks, so the real stage split
(parallel/stages.py), tensor parallelism (parallel/tensor_parallel.py), recompute wrappers and FSDP2
sharding (parallel/fsdp.py) or ZeRO-1's padded flat buckets (comm/buckets.py) run exactly as in
training, on tensors without storage. Bytes follow the runtime's allocations per shard mode
(planner/memory.py's table), from the shapes those modules really hold on the role's first rank: fp32
parameters, gradients for the trainable ones, ZeRO-1's padded buffers and master slices, two Adam
moments per optimizer parameter, the bf16 gather buffer of a bf16 wire. A 1,172-GPU plan rehearses on
a laptop in well under a minute.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

GB = 1e9


def _fake_group(world: int) -> None:
    from ..base.torch_compat import fake_store

    dist.init_process_group("fake", store=fake_store()(), rank=0, world_size=world)


def _meshes(unit):
    """(FSDP mesh or None, TP mesh or None) for the role's first rank, over the fake group."""
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = [], []
    if unit.fsdp and unit.hsdp_replicas > 1:
        shape += [unit.hsdp_replicas, unit.dp // unit.hsdp_replicas]
        names += ["replicate", "shard"]
    else:  # context-parallel ranks reduce and shard gradients with the replicas (ZeRO-1 over dp x cp)
        shape.append(unit.dp * getattr(unit, "cp", 1))
        names.append("shard")
    shape.append(unit.tp)
    names.append("tp")
    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
    fsdp = None
    if unit.fsdp:
        fsdp = mesh["replicate", "shard"] if unit.hsdp_replicas > 1 else mesh["shard"]
    return fsdp, (mesh["tp"] if unit.tp > 1 else None)


def _numel(param) -> int:
    return (param._local_tensor if hasattr(param, "_local_tensor") else param).numel()


def _expert_share(model, ep: int) -> set[int]:
    """Expert parallelism: keep the experts EP rank 0 holds in every MoE layer (1/ep of them, as
    parallel/expert_parallel.py does) and return their parameters' ids."""
    from ..models.moe import moe_layers
    from ..parallel.expert_parallel import expert_range

    held: set[int] = set()
    for layer in moe_layers(model):
        keep = expert_range(layer.num_experts, ep, 0)
        for key in list(layer.experts.keys()):
            if int(key) not in keep:
                del layer.experts[key]
        held |= {id(p) for p in layer.experts.parameters()}
    return held


def count_role(cfg, unit, stage_index: int, wire: torch.dtype) -> dict[str, float]:
    """Model-state bytes of pipeline rank ``stage_index`` of ``unit``, built on meta with the runtime's code: its
    stage, or under a V-shaped schedule (zbv, dualpipev) its two of 2 pp stages, counted apart and added."""
    from ..schedule.generators import V_SHAPED

    if cfg.schedule.get("fill_bubbles", False) and "encoder" in unit.modules and unit.pp > 1:
        return _count_filled(cfg, unit, stage_index, wire)
    if cfg.schedule.name not in V_SHAPED or unit.pp == 1:
        return _count_stage(cfg, unit, stage_index, unit.pp, wire)
    halves = [_count_stage(cfg, unit, s, 2 * unit.pp, wire) for s in (stage_index, 2 * unit.pp - 1 - stage_index)]
    return {part: halves[0][part] + halves[1][part] for part in halves[0]}


def _count_filled(cfg, unit, stage_index: int, wire: torch.dtype) -> dict[str, float]:
    """schedule.fill_bubbles: the rank's encoder chunk (its blocks of schedule.fill_split) and its LLM stage,
    counted apart and added, as parallel/stages.py builds them."""
    from dataclasses import replace

    from ..parallel.bubble_plan import encoder_split
    from ..parallel.units import ENCODER_MODULES

    chunk = replace(unit, name="encoder", modules=ENCODER_MODULES)
    llm = replace(unit, modules=tuple(m for m in unit.modules if m not in ENCODER_MODULES))
    blocks = encoder_split(cfg, unit.pp)
    parts = [
        _count_stage(cfg, chunk, stage_index, unit.pp, wire, blocks),
        _count_stage(cfg, llm, stage_index, unit.pp, wire),
    ]
    return {part: parts[0][part] + parts[1][part] for part in parts[0]}


def _stage_split(cfg, unit, stages: int, blocks: tuple[int, ...] | None):
    """The blocks per stage the runtime builds: parallel.pp_split for the LLM (rehearsed per rank, a loop as vpp 1:
    a split of pp stages), the encoder chunk's ``blocks`` (schedule.fill_split) for an encoder, else even."""
    if unit.name != "llm":
        return blocks
    split = cfg.parallel.get("pp_split")
    return split if split is not None and not isinstance(split, str) and len(split) == stages else None


def _built_stage(cfg, unit, stage_index: int, stages: int, wire, blocks, fsdp_mesh, tp_mesh):
    """The stage on meta as the runtime builds it (tensor-parallel, recomputing, sharded), and the ids of the expert
    parameters its EP rank holds."""
    from ..data.tokenizer import tokenizer_for
    from ..parallel.fsdp import apply_fsdp
    from ..parallel.recompute import apply_recompute
    from ..parallel.stages import build_unit_stage
    from ..parallel.tensor_parallel import apply_tensor_parallel

    split = _stage_split(cfg, unit, stages, blocks)
    stage = build_unit_stage(cfg.model, tokenizer_for(cfg), unit.name, unit.modules, stage_index, stages, split=split)
    if tp_mesh is not None:
        apply_tensor_parallel(stage.model, tp_mesh, cfg.parallel.comm.tp_overlap, cfg.parallel.sequence_parallel)
    apply_recompute(stage.model, unit.recompute, unit.recompute_every, tp_mesh and tp_mesh.get_group())
    held = _expert_share(stage.model, unit.ep) if getattr(unit, "ep", 1) > 1 else set()
    if fsdp_mesh is not None:  # the held experts stay whole, outside FSDP2 (train/unit_engine.py)
        ignored = {p for p in stage.model.parameters() if id(p) in held}
        apply_fsdp(stage, fsdp_mesh, unit.shard, wire, ignored or None)
    return stage, held


def _count_stage(
    cfg, unit, stage_index: int, stages: int, wire: torch.dtype, blocks: tuple[int, ...] | None = None
) -> dict[str, float]:
    """Model-state bytes of stage ``stage_index`` of ``stages`` of ``unit``."""
    from ..comm.buckets import FlatBuckets, bucket_numel
    from .memory import optimizer_state_bytes

    replicas = unit.dp * getattr(unit, "cp", 1)  # the ZeRO-1 group: dp x cp (train/unit_engine.py)
    _fake_group(replicas * unit.tp)
    try:
        fsdp_mesh, tp_mesh = _meshes(unit)
        stage, held = _built_stage(cfg, unit, stage_index, stages, wire, blocks, fsdp_mesh, tp_mesh)
        named = list(stage.model.named_parameters())
        # the experts an EP rank holds are stepped by their own optimizer (train/expert_optim.py): fp32
        # parameters that are their own masters, gradients and AdamW moments, outside the ZeRO-1 buffers
        experts = sum(_numel(p) for _, p in named if id(p) in held)
        trainable = [(n, p) for n, p in named if p.requires_grad and id(p) not in held]
        frozen = sum(_numel(p) for _, p in named if not p.requires_grad)
        counted = {"params": 0.0, "grads": 0.0, "master": 0.0, "moments": 0.0, "buffers": 0.0}
        if unit.shard == "zero1":
            size = bucket_numel(cfg.parallel.comm.bucket_mb)
            graded = cfg.parallel.comm.graded_buckets
            rank = 0
            decay = [(n, p) for n, p in trainable if p.ndim >= 2]
            no_decay = [(n, p) for n, p in trainable if p.ndim < 2]
            # local SGD's ZeRO-1 workers (hsdp_replicas = workers): the optimizer is split over one worker
            split = replicas // unit.hsdp_replicas
            flats = [
                FlatBuckets(group, split, rank, unit.tp, size, torch.device("meta"), graded)
                for group in (decay, no_decay)
            ]
            padded = sum(f.padded for f in flats if f.params)
            shard = sum(f.shard_numel for f in flats if f.params)
            # local SGD's anchors and outer momentum: a share of the whole parameters, as under DDP
            _, (anchor, outer) = optimizer_state_bytes(cfg)
            learn = sum(_numel(p) for _, p in trainable)
            counted.update(
                params=4.0 * (padded + frozen),
                grads=4.0 * padded,
                master=4.0 * shard + anchor * learn,
                moments=8.0 * shard + outer * learn,
            )
            if wire != torch.float32:
                counted["buffers"] = 2.0 * padded
            for part, per in (("params", 4.0), ("grads", 4.0), ("moments", 8.0)):
                counted[part] += per * experts
        else:  # none (DDP: gradients are bucket views) and FSDP2 (the local shards)
            learn = sum(_numel(p) for _, p in trainable)
            # optim=sgd's moments (4 bytes or none); local SGD's anchors and outer momentum, split by bytes over
            # the worker's processes (train/local_sgd/sync.py): the same per-parameter bytes as the planner's
            moments, (anchor, outer) = optimizer_state_bytes(cfg)
            if fsdp_mesh is not None:  # per element of the local shard: the anchors are shards too, not a share
                shards = unit.dp // unit.hsdp_replicas
                anchor, outer = anchor * shards, outer * shards
            counted.update(
                params=4.0 * (learn + frozen + experts),
                grads=4.0 * (learn + experts),
                master=anchor * learn,
                moments=(moments + outer) * learn + 8.0 * experts,
            )
        if getattr(unit, "offload", "none") == "optimizer":  # on the host (parallel/offload.py, CPUOffloadPolicy)
            moved = ("master", "moments") if unit.shard == "zero1" else ("params", "grads", "master", "moments")
            counted.update(dict.fromkeys(moved, 0.0))
        counted["total"] = sum(counted.values())
        return counted
    finally:
        dist.destroy_process_group()


def rehearse(cfg, run_dir: Path | None = None, progress=print, layout=None) -> dict:
    """Count every role of ``cfg``'s (non-auto) layout and compare with the planner's model state.
    ``layout``: the run's resolved one; None: ``cfg``'s, resolved here (the planner's own dry run)."""
    from ..parallel.resolved import config_layout
    from .api import config_roles

    started = time.perf_counter()
    layout = layout or config_layout(cfg)
    roles, context = config_roles(cfg, layout)
    wire = _planned_wire(cfg)
    rows = []
    for role in roles:
        unit = layout.unit(role.unit)
        counted = count_role(cfg, unit, role.pp, wire)
        predicted = role.state.as_dict()
        rows.append(
            {
                "role": f"{role.unit} pp{role.pp}",
                "ranks": unit.dp * unit.tp * getattr(unit, "cp", 1),
                "shard": role.shard,
                "recompute": role.recompute,
                "predicted": predicted,
                "counted": counted,
                "ratio": counted["total"] / predicted["total"] if predicted["total"] else float("nan"),
            }
        )
        progress(
            f"  {rows[-1]['role']:14s} {role.shard:6s} {role.recompute:>12s}  planned {predicted['total'] / GB:9.2f} GB"
            f"  rehearsed {counted['total'] / GB:9.2f} GB  ({rows[-1]['ratio'] - 1:+.2%})"
        )
    result = {**context, "roles": rows, "seconds": time.perf_counter() - started}
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / "rehearsal.json").write_text(json.dumps(result, indent=1))
    return result


def _planned_wire(cfg) -> torch.dtype:
    """The wire dtype of the precision the plan assumes (``parallel.comm.wire_dtype=auto``: bf16 under
    bf16-mixed), as the runtime then resolves it."""
    from .costs import planned_precision

    choice = cfg.parallel.comm.wire_dtype
    if choice == "auto":
        return torch.bfloat16 if planned_precision(cfg) == "bf16-mixed" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[choice]
