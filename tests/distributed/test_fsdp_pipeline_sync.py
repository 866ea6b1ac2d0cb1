"""FSDP2 gathered once per step (parallel/fsdp.py ``FsdpStepSync``): over a step of 4 microbatches a ZeRO-3 stage
under a pipeline all-gathers each FSDP group once and reduce-scatters it once (in its last backward), where plain
FSDP2 does both per microbatch (the all-gather twice: forward and backward); zero2 (the Playbook's ZeRO-2)
reduce-scatters every microbatch, gathers once per step (after the optimizer step) and keeps the parameters
replicated between steps; the gradients are the same (2 gloo ranks, fp32). Without a pipeline, zero3 keeps a
stage's last block, LM head and root gathered from their forward to their backward (TorchTitan's default).
Training with it: tests/distributed/test_fsdp.py and test_all_dimensions.py run ZeRO-3 stages in pipelines
against one process."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .spawn import start_processes

pytestmark = pytest.mark.distributed

WORLD, MICROBATCHES = 2, 4


# FSDP2's collectives by the names torch.distributed gives them (2.13: the *_single forms)
COLLECTIVES = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
}


def _counted(counts: dict):
    """Wrap the collectives FSDP2 issues, counting calls by kind."""
    originals = {}
    for name, kind in COLLECTIVES.items():
        if not hasattr(dist, name):
            continue
        originals[name] = getattr(dist, name)

        def wrapper(*args, _name=name, _kind=kind, **kwargs):
            counts[_kind] = counts.get(_kind, 0) + 1
            return originals[_name](*args, **kwargs)

        setattr(dist, name, wrapper)
    return originals


def _step(pipelined: bool, rank: int) -> tuple[dict, list[torch.Tensor]]:
    from torch.distributed.fsdp import fully_shard

    from disttrain_core.parallel.fsdp import FsdpStepSync

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    for module in (model[0], model[2], model):
        fully_shard(module, reshard_after_forward=True)  # zero3
    sync = FsdpStepSync({0: model}, "zero3") if pipelined else None
    inputs = torch.randn(MICROBATCHES, 3, 8, generator=torch.Generator().manual_seed(1 + rank))
    counts: dict = {}
    originals = _counted(counts)
    try:
        if sync is not None:
            sync.begin_step()
        for k in range(MICROBATCHES):
            loss = model(inputs[k]).pow(2).sum()
            if sync is not None and k == MICROBATCHES - 1:
                sync.arm(0)  # what the executor does before the stage's last backward of the step
            loss.backward()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    grads = [p.grad.to_local().clone() for p in model.parameters()]
    with torch.no_grad():  # a forward outside a step (evaluation) reshards after itself, as zero3 does
        model(inputs[0])
    counts["sharded after"] = all(isinstance(p, DTensor) for p in model.parameters())
    return counts, grads


def _zero2_steps(rank: int) -> dict:
    """Two steps of zero2 as the units engine runs it (FsdpStepSync without deferred reduction, the optimizer's
    regather): collectives per step, whether the parameters are replicated after each optimizer step, and the
    first step's gradients (against plain FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    from disttrain_core.config.schema import OptimConfig
    from disttrain_core.parallel.fsdp import FsdpStepSync, ShardedOptimizer, fsdp_modules

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    for module in (model[0], model[2], model):
        fully_shard(module, reshard_after_forward=False)  # zero2
    sync = FsdpStepSync({0: model}, "zero2", defer_reduce=False)
    named = list(model.named_parameters())
    optimizer = ShardedOptimizer(named, OptimConfig(), copies=WORLD, regather=fsdp_modules([model]))
    inputs = torch.randn(MICROBATCHES, 3, 8, generator=torch.Generator().manual_seed(1 + rank))
    result: dict = {"steps": []}
    for step in range(2):
        counts: dict = {}
        originals = _counted(counts)
        try:
            sync.begin_step()
            for k in range(MICROBATCHES):
                loss = model(inputs[k]).pow(2).sum()
                if k == MICROBATCHES - 1:
                    sync.arm(0)
                loss.backward()
            if step == 0:
                result["grads"] = [p.grad.to_local().clone() for _, p in named]
            counts["sharded at the step"] = all(isinstance(p, DTensor) for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad()
            optimizer.wait_params()
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)
        counts["replicated after"] = not any(isinstance(p, DTensor) for p in model.parameters())
        result["steps"].append(counts)
    optimizer.shard_params()  # what a checkpoint saves: the shards
    result["sharded for a checkpoint"] = all(isinstance(p, DTensor) for p in model.parameters())
    optimizer.close()
    return result


def _zero3_kept(rank: int) -> dict:
    """One microbatch of llama_tiny's stage under zero3 as apply_fsdp shards it: which groups are gathered after the
    forward, and the all-gathers of the forward and of the backward."""
    from torch.distributed.device_mesh import init_device_mesh

    from disttrain_core.config import compose
    from disttrain_core.data.batch import text_rows
    from disttrain_core.data.tokenizer import tokenizer_for
    from disttrain_core.models import materialize
    from disttrain_core.parallel.fsdp import apply_fsdp, fsdp_modules
    from disttrain_core.parallel.stages import build_unit_stage

    cfg = compose(["model=llama_tiny", "paths.output_dir=/nonexistent/fsdp"])
    stage = build_unit_stage(cfg.model, tokenizer_for(cfg), "llm", ("llm",), 0, 1)
    apply_fsdp(stage, init_device_mesh("cpu", (WORLD,)), "zero3", None)
    materialize(stage, "cpu", seed=0, std=0.02)
    llm = stage.model.llm
    blocks = list(llm.layers.values())
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(rank))
    counts: dict = {}
    originals = _counted(counts)
    try:
        out = stage(None, text_rows(tokens, tokens))
        forward = counts.get("all_gather", 0)
        gathered = {
            name: not any(isinstance(p, DTensor) for p in module.parameters())
            for name, module in (("first block", blocks[0]), ("last block", blocks[-1]), ("head", llm.output))
        }
        sum(out.loss_sums.values()).backward()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return {
        "gathered after forward": gathered,
        "forward": forward,
        "backward": counts.get("all_gather", 0) - forward,
        "groups": len(fsdp_modules([stage])),
        "sharded after backward": all(isinstance(p, DTensor) for p in stage.parameters()),
    }


def _worker(rank: int, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    plain_counts, plain_grads = _step(False, rank)
    counts, grads = _step(True, rank)
    worst = max((a - b).abs().max().item() for a, b in zip(grads, plain_grads, strict=True))
    zero2 = _zero2_steps(rank)
    zero2["worst"] = max((a - b).abs().max().item() for a, b in zip(zero2.pop("grads"), plain_grads, strict=True))
    kept = _zero3_kept(rank)
    torch.save(
        {"plain": plain_counts, "pipelined": counts, "worst": worst, "zero2": zero2, "kept": kept}, f"{out}/{rank}.pt"
    )
    dist.destroy_process_group()


def test_fsdp2_gathers_once_per_step_pipelined_and_keeps_the_last_groups_gathered(tmp_path):
    start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD)
    groups = 2  # the two linear layers (the root holds no parameters of its own)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"{rank}.pt")
        assert result["worst"] < 1e-6, result
        assert result["pipelined"] == {"all_gather": groups, "reduce_scatter": groups, "sharded after": True}, result
        plain = result["plain"]
        assert plain["reduce_scatter"] == groups * MICROBATCHES and plain["sharded after"], result
        assert plain["all_gather"] >= groups * MICROBATCHES, result  # and again for backward
        # zero2 (the Playbook's ZeRO-2): one all-gather per group per step -- the first step's in its first
        # forward, then right after each optimizer step -- a reduce-scatter per microbatch, and the parameters
        # replicated between steps, the shards again for a checkpoint
        zero2 = result["zero2"]
        assert zero2["worst"] < 1e-6, zero2
        for counts in zero2["steps"]:
            assert counts["reduce_scatter"] == groups * MICROBATCHES, zero2
            assert counts["sharded at the step"] and counts["replicated after"], zero2
        assert zero2["steps"][0]["all_gather"] == 2 * groups, zero2  # the first forward's and the step's
        assert zero2["steps"][1]["all_gather"] == groups, zero2  # only the step's
        assert zero2["sharded for a checkpoint"], zero2
        # TorchTitan's default (parallel/fsdp.py kept_after_forward): llama_tiny's stage under zero3 (7 groups: the
        # embedding, 4 blocks, the head, the root) gathers every group in the forward, keeps the last block, the
        # head and the root gathered after it, and gathers only the other 4 again in the backward (7 without the
        # policy), after which every parameter is a shard again
        kept = result["kept"]
        assert kept["gathered after forward"] == {"first block": False, "last block": True, "head": True}, kept
        assert (kept["groups"], kept["forward"], kept["backward"]) == (7, 7, 4), kept
        assert kept["sharded after backward"], kept
