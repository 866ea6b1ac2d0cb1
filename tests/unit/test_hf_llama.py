"""Hugging Face LlamaForCausalLM <-> our Llama: import, export, config checks (fp32, tiny models)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from disttrain_core.config import LlamaConfig, ModelConfig, RopeScalingConfig
from disttrain_core.models.hf import PretrainedError, pretrained_state
from disttrain_core.models.hf.llama import (
    export_llama,
    hf_llama_config,
    hf_to_interleaved,
    import_llama,
    interleaved_to_hf,
    llama_config,
    llama_overrides,
)
from disttrain_core.models.llama import Llama, rope_table
from disttrain_core.models.mllm import MultimodalLLM

transformers = pytest.importorskip("transformers")

SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # wavelengths 6.3 (kept), 19.9 (blended), 62.8+ (divided)
}
SEQ_LEN = 48  # beyond original_max_position_embeddings


def _hf_config(**changes):
    fields = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=SEQ_LEN,
    )
    fields.update(changes)
    if fields.get("rope_scaling"):
        fields["rope_scaling"] = dict(fields["rope_scaling"])  # transformers adds rope_theta to it in place
    return transformers.LlamaConfig(**fields)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is far from uniform; norm weights away from 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if param.ndim == 1 else 0.1 * noise)


def _hf_model(directory, seed=0, **changes):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_hf_config(**changes)).eval()
    _randomize(model, seed)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def _model_cfg(llm: LlamaConfig, directory) -> ModelConfig:
    return ModelConfig(name="hf_llama", family="llama", seq_len=SEQ_LEN, llm=llm, init_from=str(directory))


def _tokens(seed=1):
    return torch.randint(0, 128, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "changes",
    [{}, {"rope_scaling": SCALING, "rope_theta": 10000.0, "tie_word_embeddings": True}],
    ids=["plain", "llama3_rope_tied"],
)
def test_import_then_export_matches_transformers(tmp_path, changes):
    hf = _hf_model(tmp_path / "hf", **changes)
    hf_json = json.loads((tmp_path / "hf" / "config.json").read_text())
    llm_cfg = llama_config(hf_json)
    assert (llm_cfg.rope_scaling is not None) == ("rope_scaling" in changes)

    # Through model.init_from, into the full model's parameter names.
    state = pretrained_state(_model_cfg(llm_cfg, tmp_path / "hf"))
    assert all(name.startswith("llm.") for name in state)
    model = MultimodalLLM(_model_cfg(llm_cfg, tmp_path / "hf"), image_token_id=0, gen_token_id=1).eval()
    model.load_state_dict(state, strict=True)

    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
        got = model.llm(tokens)
    assert (got - want).abs().max().item() <= 1e-5

    # The permutation matters: without it the logits are far off.
    unpermuted = dict(state)
    for name in state:
        if name.endswith(("wq.weight", "wk.weight")):
            heads = llm_cfg.n_heads if "wq" in name else llm_cfg.n_kv_heads
            unpermuted[name] = interleaved_to_hf(state[name], heads)
    wrong = MultimodalLLM(_model_cfg(llm_cfg, tmp_path / "hf"), 0, 1).eval()
    wrong.load_state_dict(unpermuted)
    with torch.no_grad():
        assert (wrong.llm(tokens) - want).abs().max().item() > 1e-3

    # Export what was imported; transformers reads it back to the same logits.
    llm_state = {name.removeprefix("llm."): tensor for name, tensor in state.items()}
    out = export_llama(llm_state, llm_cfg, tmp_path / "out")
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (back(tokens).logits - want).abs().max().item() <= 1e-5
    assert llama_overrides(json.loads((out / "config.json").read_text())) == llama_overrides(hf_json)


def test_export_random_weights_matches_ours(tmp_path):
    llm_cfg = LlamaConfig(
        vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, norm_eps=1e-6, rope_theta=500000.0,
        rope_scaling=RopeScalingConfig(original_max_position_embeddings=16, factor=4.0),
    )  # fmt: skip
    ours = Llama(llm_cfg, SEQ_LEN).eval()
    _randomize(ours, seed=3)
    out = export_llama(ours.state_dict(), llm_cfg, tmp_path / "out", eos_token_id=2)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert config["eos_token_id"] == 2 and config["rope_scaling"]["rope_type"] == "llama3"
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = _tokens(seed=2)
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() <= 1e-5
    # And back: the import reproduces our tensors exactly.
    imported = import_llama(out, config, _model_cfg(llm_cfg, out))
    for name, tensor in ours.state_dict().items():
        assert torch.equal(imported[name], tensor), name


def test_rope_table_matches_llama31():
    """Llama-3.1-8B's rope (theta 5e5, head_dim 128, llama3 scaling) at positions past 8192."""
    hf_cfg = _hf_config(
        hidden_size=256, num_attention_heads=2, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={**SCALING, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    positions = torch.tensor([[0, 1, 100, 8191, 8192, 20000, 131071]])
    cos, sin = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1), positions)
    scaling = RopeScalingConfig(**{**SCALING, "original_max_position_embeddings": 8192})
    table = rope_table(128, 131072, 500000.0, scaling=scaling)[positions[0]]
    assert torch.equal(table[..., 0], cos[0, :, :64]) and torch.equal(table[..., 1], sin[0, :, :64])
    assert torch.equal(cos[0, :, :64], cos[0, :, 64:])
    with pytest.raises(ValueError, match="yarn"):
        rope_table(128, 4, 500000.0, scaling=RopeScalingConfig(rope_type="yarn"))


def test_permutation_round_trip():
    weight = torch.arange(4 * 16 * 3, dtype=torch.float32).reshape(64, 3)
    assert torch.equal(interleaved_to_hf(hf_to_interleaved(weight, 4), 4), weight)
    # HF rows j and j + 8 of head 1 become our rows 2j, 2j + 1.
    ours = hf_to_interleaved(weight, 4)
    assert torch.equal(ours[16 + 2 * 3], weight[16 + 3]) and torch.equal(ours[16 + 2 * 3 + 1], weight[16 + 8 + 3])


def test_config_mismatch_names_both_values(tmp_path):
    _hf_model(tmp_path / "hf")
    hf_json = json.loads((tmp_path / "hf" / "config.json").read_text())
    right = llama_config(hf_json)
    wrong = dataclasses.replace(right, n_kv_heads=4, norm_eps=1e-6)
    with pytest.raises(PretrainedError) as error:
        pretrained_state(_model_cfg(wrong, tmp_path / "hf"))
    message = str(error.value)
    assert "\n" not in message
    assert "num_key_value_heads=2 but model.llm.n_kv_heads=4" in message
    assert "rms_norm_eps=1e-05 but model.llm.norm_eps=1e-06" in message
    assert "model.llm.n_kv_heads=2 model.llm.norm_eps=1e-05" in message

    scaled = dataclasses.replace(right, rope_scaling=RopeScalingConfig(factor=2.0))
    with pytest.raises(PretrainedError, match=r"rope_type=default but model.llm.rope_scaling=\{rope_type: llama3"):
        import_llama(tmp_path / "hf", hf_json, _model_cfg(scaled, tmp_path / "hf"))
    with pytest.raises(PretrainedError, match=r"override: 'model.llm=\{rope_scaling: \{rope_type: llama3, factor: 8.0"):
        import_llama(tmp_path / "hf", {**hf_json, "rope_scaling": SCALING}, _model_cfg(right, tmp_path / "hf"))
    hf_scaled = {**hf_json, "rope_scaling": {**SCALING, "factor": 2.0}}
    with pytest.raises(PretrainedError, match=r"rope_scaling.factor=2.0 but model.llm.rope_scaling.factor=8.0 "):
        import_llama(tmp_path / "hf", hf_scaled, _model_cfg(dataclasses.replace(right, rope_scaling=RopeScalingConfig(
            **{**SCALING, "original_max_position_embeddings": 32})), tmp_path / "hf"))  # fmt: skip

    for bad, match in [
        ({"attention_bias": True}, "attention_bias=True"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type='yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ]:
        with pytest.raises(PretrainedError, match=match):
            llama_overrides({**hf_json, **bad})
    assert llama_overrides({**hf_json, "head_dim": 32})["model.llm.head_dim"] == 32  # a head width of its own
    assert llama_overrides({**hf_json, "head_dim": 16})["model.llm.head_dim"] is None  # = hidden_size / heads


def test_rope_parameters_and_defaults():
    """transformers 5 writes rope_parameters; older configs rope_theta/rope_scaling; absent keys take HF defaults."""
    new_style = {
        "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96,
        "vocab_size": 128, "max_position_embeddings": 32,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 2.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0},
    }  # fmt: skip
    overrides = llama_overrides(new_style)
    assert overrides["model.llm.rope_theta"] == 1000.0 and overrides["model.llm.n_kv_heads"] == 4
    assert overrides["model.llm.norm_eps"] == 1e-6
    assert overrides["model.llm.rope_scaling"]["original_max_position_embeddings"] == 32
    config = hf_llama_config(llama_config(new_style))
    assert llama_overrides(config) == overrides


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _hf_model(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    hf_json = json.loads((tmp_path / "hf" / "config.json").read_text())
    with pytest.raises(PretrainedError, match=r"model\.layers\.1\.mlp\.up_proj\.weight \(our llm\.layers\.1\.feed"):
        import_llama(tmp_path / "hf", hf_json, _model_cfg(llama_config(hf_json), tmp_path / "hf"))
