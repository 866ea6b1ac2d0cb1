"""The LM head and loss in chunks of positions (model.loss_chunk, models/chunked_loss.py): the loss and the
gradients of the plain head (fp32, 1e-6), close under bf16 autocast, the same training losses in a model, and the
step's peak live tensor bytes lower by at least the full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disttrain_core.models.chunked_loss import linear_cross_entropy_sum


def _case(seed: int = 0, rows: int = 3, positions: int = 50, dim: int = 16, vocab: int = 97):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, positions, dim, generator=g)
    weight = torch.randn(vocab, dim, generator=g) * 0.3
    labels = torch.randint(0, vocab, (rows, positions), generator=g)
    labels[:, :5] = -100  # prompt positions take no loss
    labels[1, 20:] = -100
    return hidden, weight, labels


def _plain(hidden, weight, labels):
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def _loss_and_grads(fn, hidden, weight, labels):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, labels)
    (loss * 0.37).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 7, 64, 150, 1000])
def test_chunked_loss_and_gradients_equal_the_plain_ones_in_fp32(chunk):
    hidden, weight, labels = _case()
    want = _loss_and_grads(_plain, hidden, weight, labels)
    got = _loss_and_grads(lambda h, w, y: linear_cross_entropy_sum(h, w, y, chunk), hidden, weight, labels)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_chunked_loss_under_bf16_autocast_follows_the_plain_path():
    hidden, weight, labels = _case(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _loss_and_grads(_plain, hidden, weight, labels)
        got = _loss_and_grads(lambda h, w, y: linear_cross_entropy_sum(h, w, y, 16), hidden, weight, labels)
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.float32
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def _model(*overrides):
    from disttrain_core.config import compose
    from disttrain_core.data.tokenizer import ByteTokenizer
    from disttrain_core.models import build_model, materialize

    cfg = compose(list(overrides)).model
    model = build_model(cfg, ByteTokenizer(), device="meta")
    materialize(model, "cpu", seed=3, std=cfg.init_std)
    return model, cfg


def test_a_model_with_a_chunked_head_trains_as_one_with_the_plain_head():
    """mllm_tiny's text loss and every parameter's gradient, loss_chunk=100 against 0 (fp32)."""
    torch.manual_seed(0)
    plain, cfg = _model()
    chunked, _ = _model("model.loss_chunk=100")
    tokens = torch.randint(0, cfg.llm.vocab_size, (2, cfg.seq_len))
    labels = tokens.roll(-1, dims=1)
    labels[:, -3:] = -100
    losses = []
    for model in (plain, chunked):
        hidden = model.llm.final_norm(model.llm.run_layers(model.llm.embed(tokens)))
        loss = model.lm_loss_sum(hidden, labels)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-5)
    grads = dict(plain.named_parameters())
    for name, param in chunked.named_parameters():
        if param.grad is not None:
            diff = (param.grad - grads[name].grad).abs().max().item()
            assert diff <= 1e-6 + 1e-5 * grads[name].grad.abs().max().item(), (name, diff)


def test_the_step_peak_drops_by_at_least_the_full_logits():
    """llama_tiny with a 32K vocabulary on one row of 2,048 positions: the peak live tensor bytes of forward and
    backward (the allocator's events, train/memory_report.py) with chunks of 256 positions against the plain head."""
    from disttrain_core.train.memory_report import allocation_peak

    vocab, positions = 32768, 2048
    peaks = {}
    for chunk in (0, 256):
        model, cfg = _model(
            "model=llama_tiny",
            f"model.llm.vocab_size={vocab}",
            f"model.seq_len={positions}",
            f"model.loss_chunk={chunk}",
        )
        tokens = torch.randint(0, vocab, (1, positions), generator=torch.Generator().manual_seed(0))
        result: dict = {}
        with allocation_peak(result):
            hidden = model.llm.final_norm(model.llm.run_layers(model.llm.embed(tokens)))
            model.lm_loss_sum(hidden, tokens.roll(-1, dims=1)).backward()
        peaks[chunk] = result["peak_delta"]
    logits = positions * vocab * 4  # fp32
    assert peaks[0] - peaks[256] >= logits, (peaks, logits)


def test_the_memory_model_holds_one_chunk_of_logits():
    """tools/memory.py (the planner's model): the last stage's logits term is micro batch x positions x vocabulary
    plain, one chunk of positions x vocabulary with model.loss_chunk."""
    from .test_memory_model import memory_tool

    common = ["model=llama_tiny", "model.llm.vocab_size=32768", "model.seq_len=2048", "optim.micro_batch_size=2"]
    plain = memory_tool(*common)["roles"][0]["logits"]
    chunked = memory_tool(*common, "model.loss_chunk=256")["roles"][0]["logits"]
    assert plain == pytest.approx(chunked * 2 * 2048 / 256)
