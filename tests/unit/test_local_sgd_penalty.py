"""EDiT's penalty in one process: the EWMA z-test (one-sided, statistics from normal values only), softmax
weights over the normal workers, rollback when every worker is anomalous, and per-unit clipping of the
combined pseudo-gradient (train/local_sgd/penalty.py, train/local_sgd/sync.py)."""

import math
from types import SimpleNamespace

import pytest
import torch

from disttrain_core.train.local_sgd.penalty import Ewma, Penalty


def _cfg(**overrides):
    base = dict(anomaly=True, ewma_alpha=0.2, ewma_warmup=4, threshold=3.0, weighting=False, temperature=1.0, clip=None)
    return SimpleNamespace(**{**base, **overrides})


def test_a_large_norm_is_anomalous_a_small_one_never_and_only_normal_values_update():
    penalty = Penalty(_cfg(), units=1, workers=2)
    for value in (1.0, 1.1, 0.9, 1.05, 0.95):
        weights, flags = penalty.verdict(0, [value, value])
        assert flags == [False, False] and weights == [0.5, 0.5]
    before = penalty.detectors[0][1].state()
    weights, flags = penalty.verdict(0, [1.0, 50.0])
    assert flags == [False, True] and weights == [1.0, 0.0]
    assert penalty.detectors[0][1].state() == before  # the outlier did not move worker 1's statistics
    _, flags = penalty.verdict(0, [1e-6, 1.0])  # far below the mean: not anomalous (one-sided)
    assert flags == [False, False]


def test_softmax_weights_favour_the_smaller_norm_and_all_anomalous_gives_no_weight():
    penalty = Penalty(_cfg(anomaly=False, weighting=True, temperature=0.5), units=1, workers=3)
    weights, _ = penalty.verdict(0, [1.0, 2.0, 3.0])
    expected = [math.exp(-x / 0.5) for x in (1.0, 2.0, 3.0)]
    assert all(abs(w - e / sum(expected)) < 1e-12 for w, e in zip(weights, expected, strict=True))
    detecting = Penalty(_cfg(ewma_warmup=2), units=1, workers=2)
    for value in (1.0, 1.1, 0.9):
        detecting.verdict(0, [value, value])
    weights, flags = detecting.verdict(0, [80.0, 90.0])
    assert flags == [True, True] and weights == [0.0, 0.0]


def test_ewma_seeds_its_mean_with_the_first_value():
    ewma = Ewma(alpha=0.02)
    ewma.update(5.0)
    assert ewma.mean == 5.0 and ewma.m2 == 0.0 and ewma.z(100.0) == 0.0


def test_clipping_bounds_each_units_combined_pseudo_gradient():
    from disttrain_core.config import compose, typed_config
    from disttrain_core.data.tokenizer import build_tokenizer
    from disttrain_core.models import build_model, materialize
    from disttrain_core.train.local_sgd.sync import OuterSync

    cfg = typed_config(compose(["model=llama_tiny"]))
    model = build_model(cfg.model, build_tokenizer(cfg.data.tokenizer), device="meta")
    materialize(model, "cpu", seed=0, std=0.02)
    named = list(model.named_parameters())
    outer = {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    penalty = Penalty(_cfg(anomaly=False, clip=1e-3), units=1 + cfg.model.llm.n_layers, workers=1)
    sync = OuterSync(model, named, {n: 0 for n, _ in named}, 0, 0, None, None, 1, 1, outer, False, penalty, 0)
    start = {n: p.detach().clone() for n, p in named}
    with torch.no_grad():
        for _, p in named:
            p.add_(torch.randn_like(p))  # a pseudo-gradient of norm ~sqrt(numel) per parameter
    sync.sync_now()
    for unit in sync.units:
        moved = math.sqrt(sum(float((p.detach() - start[n]).square().sum()) for n, p in unit))
        assert 0.5e-3 < moved <= 1e-3 * (1 + 1e-5), moved


def test_step_weighting_mixes_in_each_workers_share_of_the_steps():
    """A-EDiT's step weighting: (1 - r) w + r s over the workers with a weight, renormalized; anomalous workers
    (weight 0) stay out; a rollback (all zero) and no shares leave the weights alone."""
    from disttrain_core.train.local_sgd.sync import mix_weights

    assert mix_weights([0.5, 0.5], [0.6, 0.4], 0.5) == pytest.approx([0.55, 0.45])
    assert mix_weights([0.5, 0.5], [0.6, 0.4], 1.0) == pytest.approx([0.6, 0.4])
    assert mix_weights([0.0, 1.0, 0.0], [0.5, 0.3, 0.2], 0.5) == pytest.approx([0.0, 1.0, 0.0])
    assert mix_weights([0.2, 0.8, 0.0], [0.5, 0.3, 0.2], 0.5) == pytest.approx([0.35 / 0.9, 0.55 / 0.9, 0.0])
    assert mix_weights([0.0, 0.0], [0.6, 0.4], 0.5) == [0.0, 0.0]
    assert mix_weights([0.5, 0.5], None, 0.5) == [0.5, 0.5]
