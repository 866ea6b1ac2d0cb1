"""Sequence parallelism (comm/sequence_split.py, on with TP by default: parallel.sequence_parallel).

On 2 gloo ranks, real mllm_small blocks (a Llama block; a ViT block, whose 65 tokens per image pad to 66):
- the output rows and every parameter gradient equal the unsharded block's (fp32, 1e-5 of the block's largest
  gradient entry; the norms' gradients summed over the TP group as training sums them);
- the bytes autograd saves per item, with and without sequence parallelism, against the memory model
  (planner/activation_costs.py) within the bounds of tests/unit/test_memory_precision.py, and sequence
  parallelism saves less than plain TP.
Training parity with one process runs in tests/distributed/test_vocab_parallel.py (llama_tiny, both settings),
test_units.py (disagg4_tp2: ViT and Llama), test_moe_training.py (MoE at tp2 ep2), test_all_dimensions.py.
"""

import copy
import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from .spawn import start_processes

pytestmark = pytest.mark.distributed

WORLD = 2
PRECISIONS = {"32": 0.05, "bf16-mixed": 0.10}


def _blocks(m):
    """(make block, its input for a batch, extra forward args, the unit, blocks in the unit) per block kind."""
    from disttrain_core.models.llama import Llama
    from disttrain_core.models.vit import VitBlock, vit_block_count

    llm = Llama(m.llm, m.seq_len)
    tokens = (m.encoder.image_size // m.encoder.patch_size) ** 2 + int(m.encoder.class_token)
    return {
        "llm": (lambda: llm.layers["0"], m.seq_len, m.llm.dim, (llm.rope,), m.llm.n_layers),
        "encoder": (lambda: VitBlock.of(m.encoder), tokens, m.encoder.dim, (), vit_block_count(m.encoder)),
    }


def _saved_per_item(block, rows: int, dim: int, args, precision: str, split=None) -> float:
    from disttrain_core.planner.activation_count import counted_saved_bytes

    counts = []
    for batch in (1, 2):
        x = torch.randn(batch, rows, dim, requires_grad=True)
        if split is not None:
            x = split.scatter(x.detach()).requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "32"):
            counts.append(counted_saved_bytes(lambda h: block(h, *args), (x,)))
    return counts[1] - counts[0]


def _worker(rank: int, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from disttrain_core.comm.sequence_split import SequenceSplit
    from disttrain_core.config import compose
    from disttrain_core.parallel.tensor_parallel import (
        LLAMA_PLAN,
        VIT_PLAN,
        _sequence_plan,
        sequence_parallel_partial_params,
    )

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    m = compose(["model=mllm_small"]).model
    result = {"errors": {}, "saved": {}}
    for unit, (make, rows, dim, args, _) in _blocks(m).items():
        torch.manual_seed(0)
        whole = make()
        for p in whole.parameters():  # nonzero everywhere (biases and norms included)
            torch.nn.init.normal_(p, std=0.2)
        plan = LLAMA_PLAN if unit == "llm" else VIT_PLAN
        for sequence in (False, True):
            block = copy.deepcopy(whole)
            split = SequenceSplit(dist.group.WORLD) if sequence else None
            parallelize_module(block, mesh, _sequence_plan(plan) if sequence else plan)
            block.sequence = split
            for precision in PRECISIONS:
                saved = _saved_per_item(block, rows, dim, args, precision, split)
                result["saved"][f"{unit}/{sequence}/{precision}"] = saved
            if not sequence:
                continue
            # equality with the whole block: a stack of one (scatter, block, leave)
            x = torch.randn(2, rows, dim, generator=torch.Generator().manual_seed(3))
            whole.zero_grad()
            expected = whole(x, *args)
            (expected * torch.linspace(-1, 1, expected.numel()).view_as(expected)).sum().backward()
            got = split.leave(block(split.scatter(x), *args))
            (got * torch.linspace(-1, 1, got.numel()).view_as(got)).sum().backward()
            errors = {"output": ((got - expected).abs().max() / expected.abs().max()).item()}
            partial = {id(p) for p in sequence_parallel_partial_params(torch.nn.ModuleList([block]))}
            # relative to the block's largest gradient entry (a key bias's gradient is zero up to rounding)
            largest = max(p.grad.abs().max() for p in whole.parameters())
            for (name, p), q in zip(whole.named_parameters(), block.parameters(), strict=True):
                grad = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad.clone()
                if id(q) in partial:
                    dist.all_reduce(grad, group=dist.group.WORLD)
                errors[name] = ((grad - p.grad).abs().max() / largest).item()
            result["errors"][unit] = errors
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sp")
    out = tmp / "result.json"
    start_processes(_worker, args=(str(tmp / "store"), str(out)), nprocs=WORLD)
    return json.loads(out.read_text())


def test_sequence_parallel_blocks_equal_the_whole_block(measured):
    for unit, errors in measured["errors"].items():
        assert max(errors.values()) < 1e-5, (unit, sorted(errors.items(), key=lambda e: -e[1])[:3])
        assert len(errors) > 5, errors  # every parameter was compared


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_saved_activations_match_the_memory_model_with_and_without_sequence_parallelism(measured, precision):
    from disttrain_core.config import compose
    from disttrain_core.planner import CostModel, Hardware, workload_of
    from disttrain_core.planner.costs import PlannerSettings

    cfg = compose(["model=mllm_small", "cluster=h100_80g"])
    m = cfg.model
    for unit, (*_, layers) in _blocks(m).items():
        saved = {}
        for sequence in (False, True):
            costs = CostModel(
                workload_of(m),
                Hardware.from_config(cfg.cluster, precision, peak_flops=1e12),
                PlannerSettings(precision=precision, sequence_parallel=sequence),
            )
            predicted = costs.activation_bytes(unit, WORLD, 1, "none") / layers
            saved[sequence] = measured["saved"][f"{unit}/{sequence}/{precision}"]
            assert predicted / saved[sequence] == pytest.approx(1.0, abs=PRECISIONS[precision]), (
                unit,
                sequence,
                predicted,
                saved[sequence],
            )
        assert saved[True] < 0.95 * saved[False], (unit, saved)
