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


def test_bf16_gathers_round_the_parameters_and_leave_the_master_untouched():
    exact, rounded = _model(), _model()
    fp32_zero, bf16_zero = _zero(exact, torch.float32), _zero(rounded, torch.bfloat16)
    _train((exact, fp32_zero), (rounded, bf16_zero))
    masters = bf16_zero.state_by_name()["state"]
    assert "master" not in fp32_zero.state_by_name()["state"]["0.weight"]  # fp32 parameters are the master
    for (name, full), (_, low) in zip(exact.named_parameters(), rounded.named_parameters(), strict=True):
        assert torch.equal(masters[name]["master"], full.detach()), name  # the optimizer kept full precision
        assert torch.equal(low.detach(), full.detach().to(torch.bfloat16).float()), name  # what travelled
    assert any(not torch.equal(a, b) for a, b in zip(exact.parameters(), rounded.parameters(), strict=True))


def test_a_checkpoint_restores_the_master_not_the_rounded_parameters():
    exact, rounded = _model(), _model()
    fp32_zero, bf16_zero = _zero(exact, torch.float32), _zero(rounded, torch.bfloat16)
    _train((exact, fp32_zero), (rounded, bf16_zero))
    saved = bf16_zero.state_by_name()
    resumed = _model()
    with torch.no_grad():  # what load_model_state writes first: the saved, rounded parameters
        for target, source in zip(resumed.parameters(), rounded.parameters(), strict=True):
            target.copy_(source)
    again = _zero(resumed, torch.bfloat16)
    again.load_state_by_name(saved)
    _train((exact, fp32_zero), (resumed, again), steps=1)
    for (name, full), (_, low) in zip(exact.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(again.state_by_name()["state"][name]["master"], full.detach()), name
        assert torch.equal(low.detach(), full.detach().to(torch.bfloat16).float()), name
