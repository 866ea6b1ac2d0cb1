"""The generator unit's pipeline stages (parallel/generator_stages.py): the U-Net cut at level boundaries, every
boundary carrying the features, the pending skips, the timestep embedding and the conditioning in one row per
sample. Run back to back on one process, the stages give the whole model's loss and gradients (fp32: within 1e-6)."""

from types import SimpleNamespace

import pytest
import torch

from disttrain_core.config import compose
from disttrain_core.data.tokenizer import build_tokenizer
from disttrain_core.models import materialize
from disttrain_core.parallel.generator_stages import pack, segment_ranges, unpack
from disttrain_core.parallel.stages import build_unit_stage
from disttrain_core.parallel.units import GENERATOR_MODULES


def test_segments_split_into_contiguous_runs_the_first_ones_longer():
    assert segment_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert segment_ranges(5, 5) == [range(i, i + 1) for i in range(5)]
    assert segment_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ValueError, match="use pp <= 5"):
        segment_ranges(5, 6)


def _batch(cfg, samples: int):
    g = torch.Generator().manual_seed(0)
    side = cfg.gen_image_size // cfg.latent_downsample
    return SimpleNamespace(
        gen_images=torch.randint(0, 256, (samples, 3, cfg.gen_image_size, cfg.gen_image_size), generator=g).to(
            torch.uint8
        ),
        gen_noise=torch.randn(samples, cfg.generator.in_channels, side, side, generator=g),
        gen_timesteps=torch.tensor([5, 700, 999][:samples]),
        gen_weight=torch.tensor([1.0, 0.5, 1.0][:samples]),
    )


def _stages(cfg, tokenizer, count: int):
    stages = []
    for index in range(count):
        stage = build_unit_stage(cfg, tokenizer, "generator", GENERATOR_MODULES, index, count)
        materialize(stage.model, "cpu", seed=3, std=0.2)
        stages.append(stage)
    return stages


def _run(chain, queries, batch):
    """Forward through the stages as the transport joins them (each boundary a fresh leaf whose gradient goes
    back to the sender), backward from the loss; returns the loss, the queries' gradient, every gradient."""
    inbound = queries.clone().requires_grad_(True)
    x, cuts = inbound, []
    for index, stage in enumerate(chain):
        out = stage(x, batch)
        if out.send is None:
            break
        assert out.send.shape[1:] == stage.outbound_row() == chain[index + 1].inbound_row()
        x = out.send.detach().requires_grad_(True)
        cuts.append((out.send, x))
    loss = out.loss_sums["gen_loss_sum"]
    loss.backward()
    for sent, received in reversed(cuts):
        sent.backward(received.grad)
    grads = {n: p.grad for stage in chain for n, p in stage.model.named_parameters() if p.grad is not None}
    return loss.detach(), inbound.grad, grads


@pytest.mark.parametrize("count", [2, 3, 5])
def test_stages_back_to_back_equal_the_whole_generator(count):
    cfg = compose(["model=mllm_tiny"]).model
    tokenizer = build_tokenizer(compose([]).data.tokenizer)
    batch = _batch(cfg, 3)
    queries = torch.randn(3, cfg.gen_tokens, cfg.llm.dim, generator=torch.Generator().manual_seed(1))
    loss, query_grad, grads = _run(_stages(cfg, tokenizer, 1), queries, batch)
    split_loss, split_query_grad, split_grads = _run(_stages(cfg, tokenizer, count), queries, batch)
    assert split_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    assert torch.allclose(split_query_grad, query_grad, rtol=0, atol=1e-6)
    assert set(split_grads) == set(grads) and len(grads) > 50
    worst = max((split_grads[n] - grads[n]).abs().max().item() for n in grads)
    assert worst < 1e-6


def test_pack_and_unpack_round_trip():
    from disttrain_core.models.unet import UNetState

    state = UNetState(
        torch.randn(2, 4, 3, 3),
        [torch.randn(2, 4, 3, 3), torch.randn(2, 8, 1, 1)],
        torch.randn(2, 5),
        torch.randn(2, 2, 6),
    )
    row = pack(state)
    assert row.shape == (2, 36 + 36 + 8 + 5 + 12)
    back = unpack(row, [tuple(t.shape[1:]) for t in state.tensors()], torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(back.tensors(), state.tensors(), strict=True))
