"""The generator unit in parallel (parallel/tensor_parallel.py, models/unet.py).

Tensor parallelism on 2 gloo ranks: every spatial transformer's attention heads and GEGLU width are split (each
rank holds half of every to_q/to_k/to_v/to_out and proj/gate/out weight), and the U-Net's output and every
gradient (input context, replicated weights, each rank's weight slices) equal one process's within 1e-10 of the
largest magnitude (fp64).
Training: the generator unit at tp=2 and at pp=2 (the U-Net cut at a level boundary; tests/unit/test_generator_stages.py
checks the cut itself) in a disaggregated layout matches one process over 5 steps; tp2 x pp2 in make test-slow."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from .spawn import start_processes
from .test_units import SMALL, assert_same_run, train

pytestmark = pytest.mark.distributed

WORLD = 2


def _unet(meta: bool, *overrides: str):
    from disttrain_core.config import compose
    from disttrain_core.models.common import init_weights
    from disttrain_core.models.unet import UNet

    cfg = compose(["model=mllm_tiny", *overrides]).model.generator
    with torch.device("meta" if meta else "cpu"):
        unet = UNet(cfg)
    if not meta:
        init_weights(unet, seed=0, std=0.2)
    return unet, cfg


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude (at least 1)."""
    return ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1.0)).item()


def _tensor_parallel_worker(rank: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    from disttrain_core.base.dtensor import is_sharded, local_block
    from disttrain_core.models.common import init_weights
    from disttrain_core.parallel.tensor_parallel import apply_tensor_parallel

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    unet, cfg = _unet(meta=True)  # shard before materialize, as the runtime does
    blocks = apply_tensor_parallel(unet, DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    unet.to_empty(device="cpu")
    init_weights(unet, seed=0, std=0.2)
    unet.double()
    reference = _unet(meta=False)[0].double()
    g = torch.Generator().manual_seed(1)
    sample = torch.randn(2, cfg.in_channels, 8, 8, generator=g, dtype=torch.float64)
    timesteps = torch.tensor([3, 500])
    context = torch.randn(2, 4, cfg.cross_attention_dim, generator=g, dtype=torch.float64)
    upstream = torch.randn(2, cfg.in_channels, 8, 8, generator=g, dtype=torch.float64)
    # level 0's transformers (one down, two up) and the middle block's
    errors: dict[str, float] = {"blocks": float(blocks != 4)}
    outputs = []
    for model in (unet, reference):
        ctx = context.clone().requires_grad_(True)
        result = model(sample, timesteps, ctx)
        (result * upstream).sum().backward()
        outputs.append((result.detach(), ctx.grad))
    errors["output"] = _relative(outputs[0][0], outputs[1][0])
    errors["context_grad"] = _relative(outputs[0][1], outputs[1][1])
    expected = dict(reference.named_parameters())
    split = 0
    for name, param in unet.named_parameters():
        grad, offset = local_block(param.grad)
        held = tuple(slice(o, o + n) for o, n in zip(offset, grad.shape, strict=True))
        errors[f"grad {name}"] = _relative(grad, expected[name].grad[held])
        if any(f".{part}." in name for part in ("attn1", "attn2", "ff")):
            split += 1
            errors[f"split {name}"] = float(name.endswith("weight") and not is_sharded(param))
    errors["split count"] = float(split == 0)
    # one head at level 0 (32 channels of 32): the U-Net stays whole in the group (a generator sharing another
    # unit's TP group; the generator unit of a manual layout is refused before launch)
    whole, _ = _unet(True, "model.generator.head_dim=32")
    errors["replicated"] = float(apply_tensor_parallel(whole, DeviceMesh.from_group(dist.group.WORLD, "cpu")) != 0)
    errors["replicated params"] = float(any(is_sharded(p) for p in whole.parameters()))
    torch.save(errors, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_the_tensor_parallel_unet_equals_the_whole_one(tmp_path):
    start_processes(_tensor_parallel_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD)
    for rank in range(WORLD):
        errors = torch.load(tmp_path / f"{rank}.pt")
        bad = {name: error for name, error in errors.items() if not error < 1e-10}
        assert not bad, (rank, bad)


@pytest.fixture(scope="module")
def reference(one_process):
    return one_process(*SMALL)


@pytest.mark.parametrize(
    "generator",
    [
        pytest.param(["parallel.units.generator.tp=2"], id="tp2"),
        # the U-Net cut at a level boundary: [down 0, down 1, middle] | [up 0, up 1]
        pytest.param(["parallel.units.generator.pp=2"], id="pp2"),
        pytest.param(
            ["parallel.units.generator.tp=2", "parallel.units.generator.pp=2", "trainer.devices=6"],
            id="tp2_pp2",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_the_generator_unit_in_parallel_matches_one_process(generator, reference, shards, tmp_path):
    """encoder | LLM | generator (4 processes; 6 for tp2 x pp2) against one process, mllm_tiny."""
    layout = ["parallel=disagg4_tp2", "parallel.units.llm.tp=1", *generator]
    assert_same_run(train(shards, tmp_path / "generator", *layout, *SMALL), reference)
