"""A model that reads images, video frames and audio clips (model=any2any_tiny) on embedded data with all three:
disaggregated and tensor-parallel layouts, and a data producer, reproduce one process (fp32, 5 steps, losses and
final parameters within 1e-4). The audio tower rides on the LLM unit's first stage, TP-split with it, or runs as a
unit of its own beside the image encoder's (and the audio generator beside the image generator's). With a video tower
(model=any2any_video_tiny) the frames go to it, and the three encoders run as three units side by side."""

from __future__ import annotations

import pytest

from ..conftest import read_metrics
from .test_units import assert_same_run, train

pytestmark = pytest.mark.distributed

MODEL = ["model=any2any_tiny", "optim.global_batch_size=8", "optim.micro_batch_size=2"]


@pytest.fixture(scope="module")
def reference(any2any_shards, tmp_path_factory):
    return train(any2any_shards, tmp_path_factory.mktemp("any2any_one") / "one", *MODEL)


def test_one_process_trains_on_images_video_and_audio(reference):
    metrics = [m for m in read_metrics(reference) if "loss" in m]
    assert len(metrics) == 5 and metrics[-1]["loss"] < metrics[0]["loss"]
    assert metrics[-1]["data/skipped_samples"] == 0
    assert "data/truncated_audio" in metrics[-1]


@pytest.mark.parametrize(
    "layout",
    [
        # encoder unit, LLM at tp=2 with the audio tower TP-split in it, generator unit: 4 processes
        pytest.param(["parallel=disagg4_tp2"], id="disagg4_tp2"),
        # two data-parallel replicas fed by a data producer, each receiving only its block (clips included)
        pytest.param(
            ["trainer.devices=2", "data.producer.workers=1", "data.producer.per_rank=true"], id="dp2_producer"
        ),
        pytest.param(["parallel=disagg4_pp2"], id="disagg4_pp2", marks=pytest.mark.slow),
        # the image encoder and the audio tower as units of their own side by side (the tower at dp=2 against the
        # LLM's dp=1), both feeding the LLM; the image and the audio generator side by side, both fed its queries;
        # a data producer sends each process only what its unit reads, the broker routing by the step's clip counts
        pytest.param(
            [
                "parallel=disagg5_audio",
                "parallel.units.audio_encoder.dp=2",
                "trainer.devices=6",
                "data.producer.workers=1",
                "data.producer.per_rank=true",
            ],
            id="audio_units",
        ),
    ],
)
def test_layouts_match_one_process(layout, reference, any2any_shards, tmp_path):
    assert_same_run(train(any2any_shards, tmp_path / "run", *MODEL, *layout), reference)


VIDEO = ["model=any2any_video_tiny", *MODEL[1:]]


@pytest.fixture(scope="module")
def video_reference(any2any_shards, tmp_path_factory):
    return train(any2any_shards, tmp_path_factory.mktemp("any2any_video_one") / "one", *VIDEO)


def test_one_process_trains_with_a_video_tower(video_reference):
    metrics = [m for m in read_metrics(video_reference) if "loss" in m]
    assert len(metrics) == 5 and metrics[-1]["loss"] < metrics[0]["loss"]
    assert metrics[-1]["data/skipped_samples"] == 0


@pytest.mark.parametrize(
    "layout",
    [
        # three encoder units side by side (the video tower at dp=2 against the LLM's dp=1), the LLM, two generator
        # units; a data producer sends each process only what its unit reads, the broker routing each encoder's
        # embeddings by the step's image, clip and frame-group counts
        pytest.param(
            [
                "parallel=disagg6_video",
                "parallel.units.video_encoder.dp=2",
                "trainer.devices=7",
                "data.producer.workers=1",
                "data.producer.per_rank=true",
            ],
            id="three_encoder_units",
        ),
        # the video tower in the LLM unit's first stage, tensor-parallel with it (tp=2)
        pytest.param(["parallel=disagg4_tp2"], id="colocated_tp2"),
        # every tower in the LLM's first stage at dp=2, its images, clips and frame groups rebalanced over the two
        # replicas (parallel.rebalance_items; comm/item_balance.py)
        pytest.param(
            ["trainer.devices=2", "parallel.shard=zero1", "parallel.rebalance_items=true"],
            id="colocated_dp2_rebalanced",
        ),
    ],
)
def test_video_tower_layouts_match_one_process(layout, video_reference, any2any_shards, tmp_path):
    assert_same_run(train(any2any_shards, tmp_path / "run", *VIDEO, *layout), video_reference)
