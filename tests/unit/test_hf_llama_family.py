"""The Llama family beside Llama (models/hf/llama_layout.py): Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms, a
head width of its own), Mistral (a sliding window). Each imports from transformers' own tiny random model to its
logits within 1e-5 (fp32), exports back to the same logits, and round-trips our tensors exactly."""

from __future__ import annotations

import json

import pytest
import torch

from disttrain_core.config import LlamaConfig, ModelConfig
from disttrain_core.models.hf import PretrainedError, pretrained_state
from disttrain_core.models.hf.llama import export_llama, import_llama, llama_config, llama_overrides
from disttrain_core.models.llama import Llama
from disttrain_core.models.mllm import MultimodalLLM

transformers = pytest.importorskip("transformers")
SEQ_LEN = 40
SHAPE = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
    vocab_size=128, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=SEQ_LEN,
)  # fmt: skip
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": False}),
    # a window shorter than the sequence, so it changes the logits (checked below)
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 12, "head_dim": None}),
}


def _randomize(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            norm = param.ndim == 1 and "bias" not in name
            param.copy_(1.0 + 0.2 * noise if norm else 0.1 * noise)


def _hf_model(family: str, directory, seed=0):
    config_class, model_class, changes = FAMILIES[family]
    config = getattr(transformers, config_class)(**SHAPE, **changes)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    _randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def _model_cfg(llm: LlamaConfig, directory) -> ModelConfig:
    return ModelConfig(name="hf_family", family="llama", seq_len=SEQ_LEN, llm=llm, init_from=str(directory))


def _tokens(seed=1):
    return torch.randint(0, 128, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_and_export_match_transformers(tmp_path, family):
    hf = _hf_model(family, tmp_path / "hf")
    hf_json = json.loads((tmp_path / "hf" / "config.json").read_text())
    llm = llama_config(hf_json)
    assert (llm.qkv_bias, llm.qk_norm) == (family == "qwen2", family == "qwen3")
    assert llm.head_dim == (32 if family == "qwen3" else None)
    assert llm.sliding_window == (12 if family == "mistral" else None)
    state = pretrained_state(_model_cfg(llm, tmp_path / "hf"))
    model = MultimodalLLM(_model_cfg(llm, tmp_path / "hf"), image_token_id=0, gen_token_id=1).eval()
    model.load_state_dict(state, strict=True)
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
        got = model.llm(tokens)
        assert (got - want).abs().max().item() <= 1e-5
        if family == "mistral":  # the window is applied: without it the logits differ
            for block in model.llm.layers.values():
                block.attention.window = None
            assert (model.llm(tokens) - want).abs().max().item() > 1e-3
    llm_state = {name.removeprefix("llm."): tensor for name, tensor in state.items()}
    out = export_llama(llm_state, llm, tmp_path / "out")
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == [FAMILIES[family][1]]
    back = getattr(transformers, FAMILIES[family][1]).from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        assert (back(tokens).logits - want).abs().max().item() <= 1e-5
    assert llama_overrides(exported) == llama_overrides(hf_json)
    again = import_llama(out, exported, _model_cfg(llm, out))
    for name, tensor in llm_state.items():
        assert torch.equal(again[name], tensor), name


def test_what_the_family_cannot_represent_is_refused_in_one_line(tmp_path):
    _hf_model("qwen2", tmp_path / "hf")
    hf_json = json.loads((tmp_path / "hf" / "config.json").read_text())
    with pytest.raises(PretrainedError, match="use_sliding_window=true .* not supported"):
        llama_overrides({**hf_json, "use_sliding_window": True})
    qwen3 = {**hf_json, "architectures": ["Qwen3ForCausalLM"], "attention_bias": True}
    with pytest.raises(PretrainedError, match="attention_bias=True is not supported"):
        llama_overrides(qwen3)
    plain = llama_config({**hf_json, "architectures": ["LlamaForCausalLM"]})  # our Llama without the biases
    with pytest.raises(PretrainedError, match=r"architectures \(q/k/v biases\)=True but model.llm.qkv_bias=False"):
        import_llama(tmp_path / "hf", hf_json, _model_cfg(plain, tmp_path / "hf"))


def test_a_window_as_long_as_the_sequence_is_plain_causal_attention():
    llm = LlamaConfig(vocab_size=128, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96, sliding_window=SEQ_LEN)
    windowed = Llama(llm, SEQ_LEN).eval()
    plain = Llama(LlamaConfig(**{**llm.__dict__, "sliding_window": None}), SEQ_LEN).eval()
    plain.load_state_dict(windowed.state_dict())
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(windowed(tokens), plain(tokens))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.llm.sliding_window=64", "parallel.cp=2", "trainer.devices=2"], "context parallelism's attention"),
        (["model.llm.sliding_window=64", "data.packing.enabled=true"], "packed-document kernels do not apply"),
        (
            [
                "model.llm.qkv_bias=true",
                "parallel.mode=megatron",
                "parallel.tp=2",
                "trainer.devices=2",
                "parallel.comm.tp_overlap=true",
            ],
            "without their biases",
        ),  # fmt: skip
        (["model.llm.head_dim=3"], "head size 3 must be even"),
        (["model.llm.dim=130"], "set model.llm.head_dim for a head width of its own"),
    ],
)
def test_family_options_the_runtime_does_not_apply_are_refused_before_launch(compose_cfg, overrides, message):
    from disttrain_core.validation import ConfigError, validate_config

    with pytest.raises(ConfigError, match=message):
        validate_config(compose_cfg("model=llama_tiny", *overrides))
