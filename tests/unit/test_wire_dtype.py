"""bf16 on the wire under bf16-mixed: ZeRO-1 gathers bf16 parameters while the fp32 master stays in the
optimizer (and in checkpoints, so a resume loses nothing)."""

import torch

from disttrain_core.config import OptimConfig
from disttrain_core.parallel.zero import ZeroOneOptimizer


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 17), torch.nn.LayerNorm(17), torch.nn.Linear(17, 5))


def _zero(model, dtype):
    return ZeroOneOptimizer(list(model.named_parameters()), OptimConfig(lr=1e-2), None, 1, 0, tp=1, gather_dtype=dtype)


def _train(*pairs, steps=3):
    """Identical gradients into every (model, optimizer); a step each."""
    for step in range(steps):
        for model, zero in pairs:
            generator = torch.Generator().manual_seed(step)
            for param in model.parameters():  # in place: the .grad are views of ZeRO-1's gradient buffer
                param.grad.copy_(torch.randn(param.shape, generator=generator))
            zero.reduce_gradients()
            zero.step()
            zero.zero_grad()
            zero.wait_params()


def _masters(zero, model):
    """The master values a checkpoint holds (the ``model.<name>`` chunks), as full tensors."""
    state, masters = zero.checkpoint_state(rank=0, world=1, saving=True), {}
    for name, param in model.named_parameters():
        full, chunks = torch.zeros(param.shape), state[f"model.{name}"]
        if isinstance(chunks, torch.Tensor):  # one replica owns it whole: a plain tensor
            masters[name] = chunks.clone()
            continue
        for shard in chunks.local_shards():
            offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))] = shard.tensor
        masters[name] = full
    return masters


def test_bf16_gathers_round_the_parameters_and_leave_the_master_untouched():
    exact, rounded = _model(), _model()
    fp32_zero, bf16_zero = _zero(exact, torch.float32), _zero(rounded, torch.bfloat16)
    _train((exact, fp32_zero), (rounded, bf16_zero))
    masters = _masters(bf16_zero, rounded)
    for (name, full), (_, low) in zip(exact.named_parameters(), rounded.named_parameters(), strict=True):
        assert torch.equal(masters[name], full.detach()), name  # the optimizer (and a checkpoint) kept full precision
        assert torch.equal(low.detach(), full.detach().to(torch.bfloat16).float()), name  # what travelled
    assert any(not torch.equal(a, b) for a, b in zip(exact.parameters(), rounded.parameters(), strict=True))


def test_a_checkpoint_restores_the_master_not_the_rounded_parameters(tmp_path):
    import torch.distributed.checkpoint as dcp

    exact, rounded = _model(), _model()
    fp32_zero, bf16_zero = _zero(exact, torch.float32), _zero(rounded, torch.bfloat16)
    _train((exact, fp32_zero), (rounded, bf16_zero))
    dcp.save(bf16_zero.checkpoint_state(rank=0, world=1, saving=True), checkpoint_id=tmp_path, no_dist=True)
    resumed = _model()  # the initial weights: everything below comes from the checkpoint
    again = _zero(resumed, torch.bfloat16)
    dcp.load(again.checkpoint_state(rank=0, world=1, saving=False), checkpoint_id=tmp_path, no_dist=True)
    again.checkpoint_loaded()
    _train((exact, fp32_zero), (resumed, again), steps=1)
    masters = _masters(again, resumed)
    for (name, full), (_, low) in zip(exact.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(masters[name], full.detach()), name
        assert torch.equal(low.detach(), full.detach().to(torch.bfloat16).float()), name
