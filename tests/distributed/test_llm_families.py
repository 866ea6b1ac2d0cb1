"""The Llama family's options in training (models/llama.py): q/k/v biases (Qwen2), per-head q/k norms with a head
width of its own (Qwen3) and a sliding window shorter than the sequence (Mistral), all on llama_tiny, trained
tensor-parallel (tp2: the biases split with their projections, the norms replicated) and fully sharded (FSDP2
zero3 over dp2) against one process: losses and parameters within 1e-4 (fp32)."""

import pytest

from .test_units import assert_same_run, train

pytestmark = pytest.mark.distributed

FAMILY = [
    "model=llama_tiny",
    "model.llm.qkv_bias=true",
    "model.llm.qk_norm=true",
    "model.llm.head_dim=48",  # 4 heads x 48 = 192 wide q, over dim 128
    "model.llm.sliding_window=64",  # model.seq_len 256
    "optim.global_batch_size=8",
    "optim.micro_batch_size=2",
]


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(["parallel.mode=megatron", "parallel.tp=2"], id="tp2"),
        pytest.param(["parallel.shard=zero3"], id="zero3_dp2"),
    ],
)
def test_family_options_train_like_one_process(layout, one_process, shards, tmp_path):
    run = train(shards, tmp_path / "two", *FAMILY, *layout, "trainer.devices=2")
    assert_same_run(run, one_process(*FAMILY))
