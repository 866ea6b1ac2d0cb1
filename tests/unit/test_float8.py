"""model.float8 (parallel/float8.py): the LLM blocks' eligible linears become torchao Float8Linear with their
names unchanged, and everything else stays; emulated on the CPU (FP8 casts, high-precision matmuls) a small
Llama trains within 2% of its fp32 loss over 30 steps. Off CUDA, on a GPU without FP8 and with tensor
parallelism the setting is refused in one line (the CPU case: tests/unit/test_bad_input.py)."""

import pytest
import torch
from torch import nn

from disttrain_core.config import compose, typed_config
from disttrain_core.models.llama import Llama, LlamaConfig
from disttrain_core.parallel.float8 import apply_float8
from disttrain_core.parallel.units import ParallelismUnit, UnitLayout
from disttrain_core.validation import ConfigError
from disttrain_core.validation.float8 import check_float8_device, check_float8_layout

pytest.importorskip("torchao.float8")

CFG = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=160)


def _llama(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(CFG, max_seq_len=32)


def test_only_the_blocks_linears_convert_and_names_stay():
    from torchao.float8.float8_linear import Float8Linear

    model = _llama()
    names = list(model.state_dict())
    assert apply_float8(model, "tensorwise", emulate=True) == 2 * 7  # q, k, v, o, w1, w2, w3 per block
    assert list(model.state_dict()) == names  # checkpoints load either way
    assert type(model.output) is not Float8Linear and isinstance(model.output, nn.Linear)
    assert all(isinstance(m, Float8Linear) for n, m in model.named_modules() if n.startswith("layers.0.attention.w"))
    odd = nn.Sequential(nn.Linear(64, 24))  # 24 is not a multiple of 16: no FP8 matmul; not in a block anyway
    assert apply_float8(odd, "rowwise", emulate=True) == 0


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_fp8_trains_within_two_percent_of_fp32(recipe):
    reference, fp8 = _llama(), _llama()
    apply_float8(fp8, recipe, emulate=True)
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, CFG.vocab_size, (8, 4, 33), generator=generator)  # 8 batches, reused
    losses = {}
    for name, model in (("fp32", reference), ("fp8", fp8)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        curve = []
        for step in range(30):
            batch = data[step % len(data)]
            logits = model(batch[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            curve.append(loss.item())
        losses[name] = curve
    assert losses["fp8"][-1] < losses["fp8"][0] - 0.5  # it learns
    for ours, theirs in zip(losses["fp8"], losses["fp32"], strict=True):
        assert abs(ours - theirs) <= 0.02 * theirs, (losses["fp8"], losses["fp32"])
    assert losses["fp8"] != losses["fp32"]  # and the casts did run


def test_a_gpu_without_fp8_and_tensor_parallelism_are_refused_in_one_line():
    cfg = typed_config(compose(["model.float8=tensorwise", "trainer.accelerator=cuda"]))
    with pytest.raises(ConfigError, match=r"this GPU \(NVIDIA A100, compute capability 8.0\) has no FP8"):
        check_float8_device(cfg, capability=(8, 0), gpu="NVIDIA A100")
    check_float8_device(cfg, capability=(9, 0), gpu="NVIDIA H100")  # passes
    layout = UnitLayout((ParallelismUnit("llm", dp=1, tp=2, pp=1, first_rank=0, modules=("llm",)),))
    with pytest.raises(ConfigError, match=r"with tensor parallelism \(llm tp=2\) is not built"):
        check_float8_layout(cfg, layout)
