"""``model.init_from`` end to end: Hugging Face Llama weights land in every rank's shard of a tensor-parallel
run exactly (checked through the run's own checkpoint, taken before any update), and a model part the
import does not cover stops the run before launch in one line (unless ``model.init_from_strict=false``)."""

import pytest
import torch

from disttrain_core.config import compose
from disttrain_core.models.hf import pretrained_state
from disttrain_core.train.checkpoint import latest_checkpoint, read_tensors

from ..conftest import cli_overrides, run_train

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")


def _hf_llama_tiny(directory):
    """A random LlamaForCausalLM with llama_tiny's shapes (conf/model/llama_tiny.yaml)."""
    config = transformers.LlamaConfig(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=352,
        vocab_size=384,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
    )
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)


def test_llama_weights_land_in_tensor_parallel_shards(shards, tmp_path):
    weights, run = tmp_path / "hf", tmp_path / "run"
    _hf_llama_tiny(weights)
    overrides = ["model=llama_tiny", f"model.init_from={weights}", "trainer.precision=32"]
    result = run_train(
        cli_overrides(shards, run)
        + overrides
        + ["parallel=megatron_tp2", "trainer.devices=2", "schedule=none", "trainer.max_steps=1", "optim.lr=1e-30"]
        + ["optim.global_batch_size=4", "optim.micro_batch_size=2", "trainer.checkpoint.save_last=true"],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "39 of 39 parameter tensors imported" in result.stdout + result.stderr
    # One update at lr 1e-30 moves a weight by at most ~1e-30: only weights that are (almost) exactly 0 change.
    saved = read_tensors(latest_checkpoint(run / "checkpoints"))
    imported = pretrained_state(compose(overrides).model)
    assert set(saved) == set(imported)
    for name, tensor in imported.items():
        assert (saved[name] - tensor.float()).abs().max().item() < 1e-25, name


def test_an_uncovered_model_part_stops_before_launch(shards, tmp_path):
    weights = tmp_path / "hf"
    _hf_llama_tiny(weights)
    result = run_train(cli_overrides(shards, tmp_path / "run") + [f"model.init_from={{llm: {weights}}}"], timeout=120)
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: model.init_from covers llm;") and "encoder (" in line, result.stderr[-2000:]
    assert "model.init_from_strict=false" in line and "Traceback" not in result.stderr
