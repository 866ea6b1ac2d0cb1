"""Item rebalancing (parallel.rebalance_items, comm/item_balance.py) trains as one process does: the image encoder
as a unit of its own at dp=2 (disaggregated, 4 processes) and colocated in the LLM's first stage at dp=4 under
FSDP2 (zero3), on shards where a third of the samples carry no image, so a replica often has none to encode. Per-step
losses and final parameters within 1e-4 of one process (fp32, 5 steps); the bytes moved per step are reported and
equal the moved images plus their embeddings. The audio and video towers' clips and frame groups:
tests/distributed/test_any2any.py (colocated_dp2_rebalanced)."""

import pytest

from ..conftest import made_once, read_metrics, shared_dir
from .test_units import SMALL, assert_same_run, train

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    from disttrain_core.config import SyntheticDataConfig
    from disttrain_core.data.synthetic import generate_shards

    out = shared_dir(tmp_path_factory) / "data" / "skewed_images"
    with made_once(out) as todo:
        if todo:
            config = SyntheticDataConfig(
                num_shards=2, samples_per_shard=24, image_side_max=128, text_only_fraction=0.35
            )
            generate_shards(config, out, processes=1)
    return out


LAYOUTS = {
    "disaggregated_dp2": ["parallel=disagg4_enc2"],
    "colocated_dp4_fsdp2": ["trainer.devices=4", "parallel.shard=zero3"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rebalanced_encoders_train_like_one_process(layout, skewed, one_process, tmp_path):
    from disttrain_core.config import compose

    run = train(skewed, tmp_path / "run", *SMALL, *LAYOUTS[layout], "parallel.rebalance_items=true")
    assert_same_run(run, one_process(*SMALL, data=skewed))
    steps = [m for m in read_metrics(run) if "loss" in m]
    assert any(m["balance/idle_replicas_before_per_step"] > 0 for m in steps), "no replica ever lacked images"
    assert sum(m["balance/largest_items_after_per_step"] for m in steps) < sum(
        m["balance/largest_items_before_per_step"] for m in steps
    )
    cfg = compose(["model=mllm_tiny"])
    side, patch = cfg.model.encoder.image_size, cfg.model.encoder.patch_size
    per_image = 3 * side * side + (side // patch) ** 2 * cfg.model.llm.dim * 4  # uint8 pixels out, fp32 rows back
    for m in steps:
        moved = m["balance/moved_items_per_step"]
        assert m["balance/moved_mb_per_step"] == pytest.approx(moved * per_image / 2**20)
    assert sum(m["balance/moved_items_per_step"] for m in steps) > 0
