"""The straggler model of data skew (planner/stragglers.py): the images-per-sample laws, the layout of sampled
batches over DP replicas, and iteration times from the schedule simulator, checked by hand on a tiny case."""

import numpy as np
import pytest

from disttrain_core.planner.presets import PRESETS
from disttrain_core.planner.stragglers import (
    Pipeline,
    batches_for,
    fixed_law,
    law_of,
    load_scales,
    mean_iteration,
    most_images,
    sampled_iteration,
    straggler_factor,
    truncated_geometric_law,
)


def _two_stage(tail=1.0, llm_dp=2, encoder_dp=2, per_slot=2, microbatches=2):
    """An encoder stage of 3 s (all of it scales with images) before an LLM stage of 3 s."""
    return Pipeline((3.0, 3.0), (3.0, 0.0), tail, microbatches, per_slot, llm_dp, encoder_dp, (encoder_dp, llm_dp))


def test_a_tiny_case_gives_the_hand_computed_iteration_time():
    """2 DP ranks, 2 microbatches of one sample per rank, mean 2 images. Rank 0 holds (2, 2): both stages take
    3 s (F 1, B 2) and 1F1B ends at 9. Rank 1 holds (0, 4): its encoder takes 0 then 6 s (F 2, B 4):
    s0F0 0-0, s0F1 0-2, s1F0 0-1, s1B0 1-3, s0B0 3-3, s1F1 3-4, s1B1 4-6, s0B1 6-10. The iteration is the
    slower rank plus the tail: 11 s against 10 s at the mean. The heavy microbatch first, (4, 0), is absorbed:
    s0F0 0-2, s0F1 2-2, s1F0 2-3, s1B0 3-5, s1F1 5-6, s1B1 6-8, s0B0 5-9, s0B1 9-9: 9 + 1."""
    pipeline = _two_stage()
    assert mean_iteration(pipeline) == pytest.approx(10.0, abs=1e-12)
    heavy_last = np.array([[2, 0], [2, 4]])  # rows: microbatches; columns: samples (rank 0, rank 1)
    assert sampled_iteration(pipeline, heavy_last, 2.0) == pytest.approx(11.0, abs=1e-12)
    heavy_first = np.array([[2, 4], [2, 0]])
    assert sampled_iteration(pipeline, heavy_first, 2.0) == pytest.approx(10.0, abs=1e-12)


def test_an_llm_rank_waits_for_the_encoder_replicas_that_hold_its_samples():
    images = np.array([[1, 5, 2, 0]])  # one slot of 4 samples, mean 2
    one_encoder = load_scales(_two_stage(llm_dp=2, encoder_dp=1, per_slot=4, microbatches=1), images, 2.0)
    assert one_encoder[:, 0].tolist() == [1.0, 1.0]  # one replica carries all 8 images: the mean load
    four_encoders = load_scales(_two_stage(llm_dp=2, encoder_dp=4, per_slot=4, microbatches=1), images, 2.0)
    assert four_encoders[:, 0].tolist() == [2.5, 1.0]  # the slowest of its two replicas
    aligned = load_scales(_two_stage(llm_dp=2, encoder_dp=2, per_slot=4, microbatches=1), images, 2.0)
    assert aligned[:, 0].tolist() == [1.5, 0.5]


def test_rebalanced_replicas_each_take_an_even_share_plus_their_exchange():
    """One slot of 4 samples holding 1, 5, 2 and 0 images over 4 encoder replicas: balanced, each encodes 2 (the
    mean load), and the busiest (the replica of 5, sending 3) adds 3 exchanges of 0.3 s over the 3 s encoder
    stage: every LLM rank waits 1.3 x the mean."""
    images = np.array([[1, 5, 2, 0]])
    four = Pipeline((3.0, 3.0), (3.0, 0.0), 1.0, 1, 4, 2, 4, (4, 2), exchange_s_per_item=0.3)
    assert load_scales(four, images, 2.0, rebalance=True)[:, 0].tolist() == pytest.approx([1.3, 1.3])
    odd = np.array([[1, 5, 2, 1]])  # 9 images: the fullest replica takes 3
    free = Pipeline((3.0, 3.0), (3.0, 0.0), 1.0, 1, 4, 2, 4, (4, 2))
    assert load_scales(free, odd, 2.0, rebalance=True)[:, 0].tolist() == pytest.approx([1.5, 1.5])


def test_no_skew_gives_factor_one_exactly():
    pipeline = Pipeline((1.7, 1.0, 1.0, 1.0), (0.7, 0.0, 0.0, 0.0), 0.3, 12, 4, 4, 4, (4,))
    law = fixed_law(3)
    reference = mean_iteration(pipeline)
    for reorder in (False, True):
        for table in batches_for(pipeline, law, reorder):
            assert (table == 3).all()
            assert sampled_iteration(pipeline, table, law.mean) == reference  # exactly, through the simulator
    assert straggler_factor(pipeline, law, False).factor == 1.0
    for name in ("laion_pairs", "highres_tiles", "gen_512"):
        assert not law_of(PRESETS[name]).skewed


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_sampler_has_the_presets_mean(name):
    """Exactly in law; within 2% over 20,000 seeded draws (mmc4's standard error there is 0.5%)."""
    preset = PRESETS[name]
    law = law_of(preset, 4096, 14)
    assert law.mean == pytest.approx(preset.images_per_sample, abs=1e-9)
    assert sum(law.probabilities) == pytest.approx(1.0, abs=1e-12)
    draws = law.sample(np.random.default_rng(1), 20_000)
    assert draws.mean() == pytest.approx(preset.images_per_sample, rel=0.02)
    assert draws.max() <= most_images(preset, 4096, 14)
    patches = (preset.encoder_px // 14) ** 2 * preset.tiles
    assert law.counts[-1] * patches <= 4096  # the heaviest sample still fits the sequence
    assert law.skewed == preset.skewed


def test_the_skewed_law_has_the_synthetic_datas_shape():
    """Decreasing like the LAION-like synthetic data's geometric law (data/synthetic.py) when the mean allows."""
    law = truncated_geometric_law(5.6, 16)
    assert all(np.diff(law.probabilities) < 0)
    with pytest.raises(ValueError):
        truncated_geometric_law(9.0, 8)


def test_skew_slows_the_rigid_layout_and_reordering_helps_the_disaggregated_plan():
    """Hand-made layouts with LAION-like skew (MMC4's law): the rigid layout folds the encoder into the first
    LLM stage of each of 4 DP ranks; the plan gives the encoder its own 2 replicas and stage. Sampled batches
    through the simulator: the rigid layout straggles; the real reordering lowers the plan's factor."""
    law = law_of(PRESETS["mmc4_interleaved"])
    rigid = Pipeline((1.6, 1.0, 1.0, 1.0), (0.6, 0.0, 0.0, 0.0), 0.2, 16, 4, 4, 4, (4,))
    plan = Pipeline((0.9, 1.0, 1.0, 1.0), (0.9, 0.0, 0.0, 0.0), 0.2, 16, 4, 4, 2, (2, 4))
    assert straggler_factor(rigid, law, False).factor > 1.02
    arrival, reordered = straggler_factor(plan, law, False), straggler_factor(plan, law, True)
    assert arrival.factor > 1.0
    assert reordered.factor < arrival.factor - 0.01
    # item rebalancing (free exchanges here) in arrival order: the rigid layout 1.048 -> 1.019, the plan 1.073 ->
    # 1.033. After the reordering it gains nothing (1.043 -> 1.045): Algorithm 2 has balanced the replicas already,
    # and the exchange makes every replica wait for the busiest in every slot, where alone each LLM rank waits
    # only for its own encoder replica and the pipeline absorbs the rest
    factors = {
        (name, reorder, rebalance): straggler_factor(layout, law, reorder, rebalance=rebalance).factor
        for name, layout in (("rigid", rigid), ("plan", plan))
        for reorder in (False, True)
        for rebalance in (False, True)
    }
    assert factors["rigid", False, False] == pytest.approx(1.048, abs=5e-4)
    assert factors["rigid", False, True] == pytest.approx(1.019, abs=5e-4)
    assert factors["plan", False, False] == pytest.approx(1.073, abs=5e-4)
    assert factors["plan", False, True] == pytest.approx(1.033, abs=5e-4)
    assert factors["plan", True, False] == pytest.approx(1.043, abs=5e-4)
    assert factors["plan", True, True] == pytest.approx(1.045, abs=5e-4)


def test_a_planned_layout_at_scale():
    """mllm9b on 256 GPUs with MMC4's law: the planner's own layouts through the model."""
    from disttrain_core.config import compose
    from disttrain_core.planner import make_plan
    from disttrain_core.planner.stragglers import pipeline_of

    preset = PRESETS["mmc4_interleaved"]
    cfg = compose(["model=mllm9b", "cluster=h100_80g", "cluster.num_gpus=256", *preset.overrides()])
    result = make_plan(cfg, progress=lambda *_: None)
    law = law_of(preset, cfg.model.seq_len, cfg.model.encoder.patch_size)
    plan = pipeline_of(result.model, result.plan.evaluation)
    rigid = pipeline_of(result.model, result.plan.baselines["megatron"].evaluation)
    # the simulator at the mean agrees with the evaluation's 1F1B formula
    assert mean_iteration(plan) == pytest.approx(result.plan.evaluation.iteration_s, rel=0.02)
    assert straggler_factor(rigid, law, False).factor > 1.0
    assert straggler_factor(plan, law, True).factor < straggler_factor(plan, law, False).factor
