"""mllm_tiny with the cross-attention resampler as its image projector (model.encoder_projector.kind=resampler):
one process trains (finite losses that move); with parallel=disagg2 the encoder unit (ViT and resampler) sends
the LLM unit num_queries rows per image through the broker, and the run equals one process within 1e-4 (fp32,
5 optimizer steps: per-step losses and final parameters)."""

import math

import pytest

from disttrain_core.train.checkpoint import latest_checkpoint, read_tensors

from ..conftest import read_metrics
from .test_units import SMALL, assert_same_run, train

pytestmark = pytest.mark.distributed

# 8 queries for the 16 patches of a 32-px image, 4 heads of 32 over the LLM's 128, 2 blocks
RESAMPLER = [
    "model.encoder_projector.kind=resampler",
    "model.encoder_projector.num_queries=8",
    "model.encoder_projector.n_heads=4",
    "model.encoder_projector.n_layers=2",
]


@pytest.fixture(scope="module")
def reference(one_process):
    return one_process(*RESAMPLER, *SMALL)


def test_one_process_trains_the_resampler(reference):
    losses = [m["loss"] for m in read_metrics(reference)]
    assert len(losses) == 5 and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0], losses
    weights = read_tensors(latest_checkpoint(reference / "checkpoints"))
    queries = [name for name in weights if name.endswith("encoder_projector.queries")]
    assert len(queries) == 1 and tuple(weights[queries[0]].shape) == (8, 128)


def test_disaggregated_encoder_and_llm_units_match_one_process(reference, shards, tmp_path):
    assert_same_run(train(shards, tmp_path / "disagg2", "parallel=disagg2", *RESAMPLER, *SMALL), reference)
