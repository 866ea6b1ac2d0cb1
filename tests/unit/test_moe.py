"""Mixture-of-experts feed-forward (models/moe.py): routing, capacity, the balancing loss and bias, gradients
against a dense reference, config validation, and a Llama built with MoE blocks."""

from __future__ import annotations

import pytest
import torch

from disttrain_core.config.model import LlamaConfig, MoeConfig
from disttrain_core.models.common import init_weights
from disttrain_core.models.llama import Llama
from disttrain_core.models.moe import (
    MoeFeedForward,
    capacity_mask,
    collect_aux_losses,
    moe_stats,
    route,
    update_expert_biases,
)
from disttrain_core.parallel.expert_parallel import validate_moe

DIM, FFN = 6, 10


def make_layer(dtype=torch.float64, seed: int = 0, **moe) -> MoeFeedForward:
    layer = MoeFeedForward(DIM, MoeConfig(**{"num_experts": 4, "top_k": 2, **moe}), FFN)
    init_weights(layer, seed, std=0.3)  # a wide init, so the router's choices are far from ties
    layer.aux_scale = 0.0  # these tests add layer.aux_loss to their losses themselves
    return layer.to(dtype)


def dense_reference(layer: MoeFeedForward, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Every expert on every token, weighted by a [N, E] gate matrix that is zero off the chosen experts
    (and on dropped assignments): no gather, no scatter, no sorting."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = layer.router(tokens).double().softmax(-1)
    scores = probs if layer.expert_bias is None else probs + layer.expert_bias.double()
    ids = scores.topk(layer.top_k, -1).indices
    chosen = probs.gather(-1, ids)
    gates = chosen / chosen.sum(-1, keepdim=True)
    if keep is not None:
        gates = gates * keep
    matrix = torch.zeros_like(probs).scatter(1, ids, gates)
    out = sum(matrix[:, e : e + 1].to(x.dtype) * layer.experts[str(e)](tokens) for e in range(layer.num_experts))
    if layer.shared is not None:
        out = out + layer.shared(tokens)
    return out.view(x.shape)


def dense_aux_loss(layer: MoeFeedForward, tokens: torch.Tensor) -> torch.Tensor:
    """coef * E * sum_e f_e * P_e written out: f_e from a [N, E] choice matrix, P_e a plain mean."""
    probs = layer.router(tokens).softmax(-1)
    chosen = torch.zeros_like(probs).scatter(1, probs.topk(layer.top_k, -1).indices, 1.0)
    fraction = chosen.sum(0) / (tokens.shape[0] * layer.top_k)
    return layer.aux_loss_coef * layer.num_experts * (fraction * probs.mean(0)).sum()


def hand_capacity_keep(ids: list[list[int]], capacity: int) -> list[list[bool]]:
    """First come, first served, token by token and slot by slot."""
    used: dict[int, int] = {}
    keep = []
    for row in ids:
        keep.append([])
        for expert in row:
            used[expert] = used.get(expert, 0) + 1
            keep[-1].append(used[expert] <= capacity)
    return keep


def test_routing_picks_the_top_k_and_renormalizes_the_gates():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
    probs, ids, gates = route(logits, top_k=2)
    assert torch.allclose(probs, logits.softmax(-1))
    assert ids.tolist() == [[1, 2], [0, 3]]
    chosen = probs.gather(-1, ids)
    assert torch.allclose(gates, chosen / chosen.sum(-1, keepdim=True))
    assert torch.allclose(gates.sum(-1), torch.ones(2))
    assert probs.dtype == gates.dtype == torch.float32  # fp32 routing whatever the model dtype
    assert route(logits.bfloat16(), top_k=1)[2].dtype == torch.float32


def test_without_capacity_nothing_is_dropped_and_output_matches_dense():
    layer = make_layer(shared_experts=1)
    x = torch.randn(3, 5, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    assert layer.last_stats.dropped.item() == 0
    assert layer.last_stats.tokens_per_expert.sum().item() == 15 * 2
    torch.testing.assert_close(out, dense_reference(layer, x), rtol=0, atol=1e-12)


def test_capacity_mask_matches_a_hand_count():
    ids = torch.tensor([[0, 1], [1, 0], [1, 2], [1, 0], [2, 1], [0, 3]])
    for capacity in (1, 2, 3):
        assert capacity_mask(ids, 4, capacity).tolist() == hand_capacity_keep(ids.tolist(), capacity)


def test_dropped_assignments_contribute_nothing():
    layer = make_layer(capacity_factor=0.5)
    x = torch.randn(12, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out = layer(x)
    ids = route(layer.router(x), 2)[1]
    capacity = -(-0.5 * 12 * 2 // 4)  # ceil(capacity_factor * tokens * top_k / experts) = 3
    keep = torch.tensor(hand_capacity_keep(ids.tolist(), int(capacity)))
    assert layer.last_stats.dropped.item() == (~keep).sum().item() > 0
    torch.testing.assert_close(out, dense_reference(layer, x, keep), rtol=0, atol=1e-12)
    # a token with both assignments dropped gets only the shared experts: zero here (there are none)
    assert torch.equal(out[~keep.any(1)], torch.zeros_like(out[~keep.any(1)]))


def test_aux_loss_matches_a_hand_computation():
    layer = make_layer(aux_loss_coef=0.1)
    x = torch.randn(10, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    layer(x)
    probs = layer.router(x).softmax(-1)
    ids = probs.topk(2, -1).indices
    expected = 0.0
    for e in range(4):
        fraction = (ids == e).sum().item() / (10 * 2)
        expected += fraction * probs[:, e].mean().item()
    assert layer.aux_loss.item() == pytest.approx(0.1 * 4 * expected, rel=1e-12)
    assert layer.aux_loss.requires_grad
    assert layer.last_stats.tokens_per_expert.tolist() == [(ids == e).sum().item() for e in range(4)]


def test_aux_free_bias_changes_the_choice_not_the_gates():
    layer = make_layer(router="aux_free")
    x = torch.randn(16, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    probs, plain_ids, _ = route(layer.router(x), 2)
    layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # expert 3 is always chosen
    layer.eval()
    out = layer(x)
    _, ids, gates = route(layer.router(x), 2, layer.expert_bias)
    assert (ids == 3).any(1).all() and not (plain_ids == 3).any(1).all()
    chosen = probs.gather(-1, ids)
    torch.testing.assert_close(gates, chosen / chosen.sum(-1, keepdim=True))  # plain probabilities
    torch.testing.assert_close(out, dense_reference(layer, x), rtol=0, atol=1e-12)
    assert layer.aux_loss.item() == 0.0  # no balancing loss with this router
    assert "expert_bias" in layer.state_dict() and "pending_load" not in layer.state_dict()


def test_aux_free_bias_update_follows_the_load():
    layer = make_layer(router="aux_free", bias_update_rate=0.01)
    x = torch.randn(16, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    layer(x)
    layer(x)  # two microbatches of one step: counts accumulate
    load = layer.last_stats.tokens_per_expert * 2
    assert torch.equal(layer.pending_load, load)
    update_expert_biases(layer)
    expected = 0.01 * torch.sign(load.double().mean() - load.double())
    torch.testing.assert_close(layer.expert_bias, expected)
    assert layer.pending_load.sum().item() == 0
    layer.eval()
    layer(x)  # evaluation forwards do not steer the bias
    assert layer.pending_load.sum().item() == 0


def test_aux_free_bias_is_zero_after_meta_materialization():
    with torch.device("meta"):
        layer = MoeFeedForward(DIM, MoeConfig(num_experts=4, router="aux_free"), FFN)
    layer.to_empty(device="cpu")
    layer.expert_bias.fill_(float("nan"))
    init_weights(layer, 0)
    assert layer.expert_bias.eq(0).all() and layer.pending_load.eq(0).all()


def test_gradcheck_on_input_and_gradients_match_dense_reference():
    layer = make_layer(shared_experts=1, capacity_factor=0.75)
    x = torch.randn(8, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(6), requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: layer(t) + layer.aux_loss, (x,), eps=1e-6, atol=1e-7)

    upstream = torch.randn(8, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    (layer(x) * upstream).sum().add(layer.aux_loss).backward()
    ids = route(layer.router(x), 2)[1]
    keep = torch.tensor(hand_capacity_keep(ids.tolist(), 3))
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    x_grad = x.grad.clone()
    layer.zero_grad()
    x.grad = None
    (dense_reference(layer, x, keep) * upstream).sum().add(dense_aux_loss(layer, x)).backward()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-12, msg=name)
    torch.testing.assert_close(x_grad, x.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_experts": 8, "top_k": 2, "ep": 3, "dp": 6}, r"ep=3 does not divide moe.num_experts=8"),
        ({"num_experts": 8, "top_k": 2, "ep": 4, "dp": 6}, r"ep=4 does not divide dp=6"),
        ({"num_experts": 4, "top_k": 5}, r"top_k=5 > moe.num_experts=4"),
        ({"num_experts": 4, "top_k": 0}, r"top_k=0"),
        ({"num_experts": 4, "top_k": 2, "capacity_factor": -1.0}, r"capacity_factor=-1.0 is negative"),
        ({"num_experts": 4, "top_k": 2, "router": "sinkhorn"}, r"router='sinkhorn' is unknown"),
    ],
)
def test_validate_moe_names_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        validate_moe(**kwargs)
    assert "\n" not in str(error.value)


def test_valid_moe_settings_pass():
    validate_moe(8, 2, ep=4, dp=8, capacity_factor=1.25, router="aux_free")
    with pytest.raises(ValueError, match="router"):
        MoeFeedForward(DIM, MoeConfig(router="nope"), FFN)


def test_llama_with_moe_blocks_trains_a_step():
    moe = MoeConfig(num_experts=4, top_k=2, shared_experts=1, expert_ffn_dim=12, capacity_factor=1.0)
    cfg = LlamaConfig(vocab_size=40, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=24, moe=moe)
    with torch.device("meta"):
        model = Llama(cfg, max_seq_len=8)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    names = dict(model.named_parameters())
    assert names["layers.1.feed_forward.experts.3.w1.weight"].shape == (12, 16)
    assert names["layers.0.feed_forward.shared.w1.weight"].shape == (12, 16)
    tokens = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)  # the aux terms' gradients enter through the blocks' outputs (aux_scale 1)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    assert collect_aux_losses(model).requires_grad
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())  # idle experts get zero gradients
    stats = moe_stats(model)
    assert stats["tokens_per_expert"].shape == (2, 4) and stats["tokens_per_expert"].sum() == 2 * 16 * 2
    assert stats["max_load_ratio"] >= 1.0


def test_attached_aux_loss_equals_adding_it_to_the_loss():
    """aux_scale s: backward through the output alone gives the gradients of output + s x aux_loss."""
    x = torch.randn(8, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    upstream = torch.randn(8, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    explicit = make_layer(aux_loss_coef=0.5)
    (explicit(x) * upstream).sum().add(0.25 * explicit.aux_loss).backward()
    attached = make_layer(aux_loss_coef=0.5)
    attached.aux_scale = 0.25
    (attached(x) * upstream).sum().backward()
    for (name, a), (_, b) in zip(explicit.named_parameters(), attached.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12, msg=name)
    assert attached.router.weight.grad.ne(0).any()
    dropped, load = attached.take_step_stats()
    assert load.sum() == 8 * 2 and dropped == 0 and attached.take_step_stats() is None


def test_aux_loss_training_balances_the_experts():
    """200 Adam steps on the balancing loss alone (the router is what it trains; inputs with a common offset
    make the initial router favour a few experts), learning rate decaying linearly to 0 so the router
    settles: max/mean load on a fixed probe batch falls from over 3 to under 1.3 (1.12 measured; 1.09-1.20
    over 8 seeds). About 0.3 s."""
    layer = make_layer(dtype=torch.float32, num_experts=8, aux_loss_coef=1.0)
    offset = torch.randn(DIM, generator=torch.Generator().manual_seed(8)) * 2
    data = torch.Generator().manual_seed(9)
    probe = torch.randn(512, DIM, generator=data) + offset
    layer.eval()
    layer(probe)
    before = layer.last_stats.load_ratio().item()
    layer.train()
    steps = 200
    optimizer = torch.optim.Adam(layer.router.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    for _ in range(steps):
        layer(torch.randn(64, DIM, generator=data) + offset)
        optimizer.zero_grad()
        layer.aux_loss.backward()
        optimizer.step()
        schedule.step()
    layer.eval()
    layer(probe)
    after = layer.last_stats.load_ratio().item()
    assert before > 3 and after < 1.3, (before, after)


def test_flop_counting_on_meta_charges_top_k_experts_per_token():
    """models/flops.py runs the model on meta tensors, where no routing exists: the layer then charges the
    balanced cost, N * top_k expert rows, plus the router."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        layer = MoeFeedForward(16, MoeConfig(num_experts=4, top_k=2, shared_experts=1), 32)
        x = torch.empty(10, 16)
        counter = FlopCounterMode(display=False)
        with counter:
            out = layer(x)
    assert out.shape == x.shape
    per_row = 2 * 16 * 32 * 3  # w1, w3 and w2 of one SwiGLU expert, 2 FLOPs per multiply-add
    assert counter.get_total_flops() == 10 * 2 * per_row + 10 * per_row + 2 * 10 * 16 * 4


def test_recomputed_forward_is_counted_once():
    """Under activation checkpointing the forward runs again inside backward: expert counts, drops and the
    aux-free load are recorded by the first pass only."""
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(16, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    plain = make_layer(capacity_factor=0.5, router="aux_free")
    plain(x).sum().backward()
    recomputed = make_layer(capacity_factor=0.5, router="aux_free")
    checkpoint(recomputed, x, use_reentrant=False).sum().backward()
    (dropped, load), (dropped_again, load_again) = plain.take_step_stats(), recomputed.take_step_stats()
    assert dropped > 0 and dropped_again == dropped and torch.equal(load_again, load)
    assert torch.equal(recomputed.pending_load, plain.pending_load) and plain.pending_load.sum() == 16 * 2


def _grouped_pair(**moe):
    """The same fp32 layer (widths that suit grouped matmuls) with the grouped and the loop kernel."""
    layers = []
    for kernel in ("grouped", "loop"):
        layer = MoeFeedForward(16, MoeConfig(**{"num_experts": 4, "top_k": 2, **moe, "experts_kernel": kernel}), 24)
        init_weights(layer, 0, std=0.3)
        layer.aux_scale = 0.0
        layers.append(layer)
    return layers


@pytest.mark.parametrize("moe", [{}, {"capacity_factor": 0.5}, {"num_experts": 8, "top_k": 1}])
def test_grouped_experts_match_the_per_expert_loop(moe):
    """One grouped matmul per projection (torch._grouped_mm) against a matmul per expert: outputs and every
    gradient within 1e-5 (fp32), with dropped assignments (capacity) and with experts that get no rows."""
    grouped, loop = _grouped_pair(**moe)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    results = []
    for layer in (grouped, loop):
        inp = x.clone().requires_grad_()
        out = layer(inp)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append((out.detach(), inp.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (out_g, dx_g, grads_g), (out_l, dx_l, grads_l) = results
    torch.testing.assert_close(out_g, out_l, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx_g, dx_l, rtol=1e-5, atol=1e-5)
    assert grads_g.keys() == grads_l.keys()
    for name in grads_l:
        assert grads_g[name] is not None, name  # every expert gets a gradient, zero when it had no rows
        torch.testing.assert_close(grads_g[name], grads_l[name], rtol=1e-5, atol=1e-5, msg=name)


def test_every_grouped_matmul_group_is_16_row_aligned(monkeypatch):
    """CUDA's grouped matmul asserts on the device unless every group's extent along the split dimension is a
    multiple of 16 bytes (an H200 stopped on the weight gradient's split of 13 rows): each expert's rows start at a
    multiple of 16 in a zero-padded layout, forward and backward, and the result still equals the loop."""
    from disttrain_core.models import grouped_experts

    grouped_experts.grouped_available(torch.device("cpu"), torch.float32)  # its probe runs before the spy
    extents, totals = [], []
    real = torch._grouped_mm

    def spy(a, b, offs=None, **kwargs):
        ends = offs.tolist()
        extents.extend(e - s for s, e in zip([0, *ends[:-1]], ends, strict=True))
        totals.append(a.shape[-1] if b.dim() == 2 else a.shape[0])  # the rows the groups split (weight grad: K)
        return real(a, b, offs=offs, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    grouped, loop = _grouped_pair(num_experts=4)
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(3))  # 74 assignments over 4 experts
    outs = []
    for layer in (grouped, loop):
        inp = x.clone().requires_grad_()
        out = layer(inp)
        out.sum().backward()
        outs.append((out.detach(), inp.grad))
    assert len(extents) == 9 * 4 and all(e % 16 == 0 for e in extents), extents
    assert all(t % 16 == 0 for t in totals), totals  # the whole split extent too (stride of the rows)
    assert any(e > 0 for e in extents)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_aligned_slots_keep_each_expert_block_in_order():
    from disttrain_core.models.grouped_experts import ALIGN_ROWS, aligned_slots, padded_rows

    ids = torch.tensor([0] * 3 + [2] * 17 + [3] * 16)  # expert 1 has no rows
    slots, ends = aligned_slots(ids, 4)
    assert ends.tolist() == [16, 16, 48, 64] and ends.dtype == torch.int32
    assert slots.tolist() == [0, 1, 2, *range(16, 33), *range(48, 64)]
    assert padded_rows(ids.numel(), 4) >= int(ends[-1]) and padded_rows(ids.numel(), 4) % ALIGN_ROWS == 0


def test_grouped_experts_under_bf16_autocast_follow_the_loop():
    grouped, loop = _grouped_pair()
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_g, out_l = grouped(x), loop(x)
    torch.testing.assert_close(out_g.float(), out_l.float(), rtol=3e-2, atol=3e-2)


def test_grouped_experts_where_they_cannot_run_are_one_line():
    layer = make_layer(experts_kernel="grouped")  # float64, widths 6 and 10: not what grouped_mm takes
    with pytest.raises(ValueError, match=r"^moe.experts_kernel=grouped: .*; use moe.experts_kernel=auto or loop$"):
        layer(torch.randn(4, DIM, dtype=torch.float64))
    assert make_layer(experts_kernel="auto")(torch.randn(4, DIM, dtype=torch.float64)).shape == (4, DIM)
    with pytest.raises(ValueError, match="moe.experts_kernel='fast' is unknown: choose one of auto, grouped, loop"):
        make_layer(experts_kernel="fast")
