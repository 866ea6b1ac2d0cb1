"""Hugging Face Whisper encoders imported into our AudioEncoder give the same hidden states (fp32)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from disttrain_core.config import AudioEncoderConfig, ModelConfig, compose  # noqa: E402
from disttrain_core.models.audio import AudioEncoder  # noqa: E402
from disttrain_core.models.hf import IMPORTERS, PretrainedError, check_pretrained, pretrained_state  # noqa: E402
from disttrain_core.models.hf.whisper import check_config, expected_shapes, hf_names  # noqa: E402

from .hf_helpers import perturbed, save  # noqa: E402

TOL = 1e-5
# conf/model/audio_encoder/audio_tiny.yaml: 1 s at 8 kHz, hop 80 -> 100 log-mel frames -> 50 positions.
TINY = dict(sample_rate=8000, clip_seconds=1.0, n_fft=200, hop_length=80, n_mels=32, dim=64, n_layers=2, n_heads=4)
FRAMES = 100


def hf_whisper_config(**overrides):
    values = dict(
        num_mel_bins=32, d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=96,
        max_source_positions=50, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=32,
        max_target_positions=16, vocab_size=60, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1,
    )  # fmt: skip
    return transformers.WhisperConfig(**{**values, **overrides})


def ours(**overrides) -> AudioEncoderConfig:
    return AudioEncoderConfig(**{**TINY, "mlp_dim": 96, **overrides})


def imported(directory: str, audio: AudioEncoderConfig) -> AudioEncoder:
    state = pretrained_state(ModelConfig(audio_encoder=audio, init_from=directory))
    assert all(name.startswith("audio_encoder.") for name in state)
    model = AudioEncoder(audio)
    model.load_state_dict({name.removeprefix("audio_encoder."): t for name, t in state.items()}, strict=True)
    return model.eval()


def whisper_encoder(hf):
    """The WhisperEncoder inside each accepted architecture."""
    if isinstance(hf, transformers.WhisperForConditionalGeneration):
        return hf.model.encoder
    return getattr(hf, "encoder", hf)


def mels() -> torch.Tensor:
    return torch.randn(2, 32, FRAMES, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    hf = perturbed(transformers.WhisperForConditionalGeneration(hf_whisper_config()))
    return hf, save(hf, tmp_path_factory.mktemp("whisper"))


@torch.no_grad()
def test_imported_tower_matches_whisper_encoder(whisper):
    hf, directory = whisper
    model = imported(directory, ours())
    features = mels()
    reference = hf.get_encoder()(input_features=features).last_hidden_state
    out = model(features)
    assert out.shape == reference.shape == (2, 50, 64)
    diff = float((out - reference).abs().max())
    print(f"WhisperForConditionalGeneration encoder max abs diff {diff:.2e}")
    assert diff <= TOL
    # Every encoder tensor of the file is used once; the decoder's are not.
    with open(f"{directory}/config.json") as handle:
        assert json.load(handle)["architectures"] == ["WhisperForConditionalGeneration"]
    encoder_params = dict(hf.model.encoder.named_parameters())
    assert len(encoder_params) == len(expected_shapes(ours())) == len(dict(model.named_parameters()))


@pytest.mark.parametrize("kind", ["WhisperModel", "WhisperEncoder", "WhisperForAudioClassification"])
@torch.no_grad()
def test_other_whisper_architectures_import(tmp_path, kind):
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cls = WhisperEncoder if kind == "WhisperEncoder" else getattr(transformers, kind)
    hf = perturbed(cls(hf_whisper_config()))
    directory = save(hf, tmp_path)
    with open(f"{directory}/config.json") as handle:
        assert json.load(handle)["architectures"] == [kind]
    features = mels()
    reference = whisper_encoder(hf)(input_features=features).last_hidden_state
    diff = float((imported(directory, ours())(features) - reference).abs().max())
    print(f"{kind} encoder max abs diff {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(dim=96), "d_model=64 but model.audio_encoder.dim=96 (override: model.audio_encoder.dim=64)"),
        (
            dict(n_layers=3, n_heads=8),
            "encoder_layers=2 but model.audio_encoder.n_layers=3; encoder_attention_heads=4 but model.audio_encoder."
            "n_heads=8 (override: model.audio_encoder.n_layers=2 model.audio_encoder.n_heads=4)",
        ),
        (dict(mlp_dim=128), "encoder_ffn_dim=96 but model.audio_encoder.mlp_dim=128"),
        (dict(n_mels=80), "num_mel_bins=32 but model.audio_encoder.n_mels=80 (override: model.audio_encoder.n_mels="),
        (
            dict(clip_seconds=2.0),
            "max_source_positions=50 but model.audio_encoder makes 100 positions (clip_seconds=2.0 at "
            "sample_rate=8000, hop_length=80) (override: model.audio_encoder.clip_seconds=1.0)",
        ),
        (
            dict(norm_eps=1e-6),
            "layer norms have eps=1e-05 but model.audio_encoder.norm_eps=1e-06 "
            "(override: model.audio_encoder.norm_eps=1e-05)",
        ),
    ],
)
def test_mismatch_names_both_values_and_the_override(whisper, overrides, message):
    _, directory = whisper
    with pytest.raises(PretrainedError) as info:
        check_pretrained(ModelConfig(audio_encoder=ours(**overrides), init_from=directory), {})
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(PretrainedError, match="does not match our config"):
        imported(directory, ours(**overrides))


def test_other_activations_are_refused(whisper):
    _, directory = whisper
    with open(f"{directory}/config.json") as handle:
        config = json.load(handle)
    check_config(config, ours())
    with pytest.raises(PretrainedError, match="activation_function=relu is not supported: the audio tower's MLP is"):
        check_config({**config, "activation_function": "relu"}, ours())


@pytest.mark.filterwarnings("ignore:At least one mel filter has all zero values")  # 32 bins over 101 frequencies
def test_a_preprocessor_config_must_describe_our_log_mels(tmp_path):
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    directory = save(WhisperEncoder(hf_whisper_config()), tmp_path)
    model_cfg = ModelConfig(audio_encoder=ours(), init_from=directory)
    check_pretrained(model_cfg, {})  # no preprocessor_config.json: nothing to compare
    extractor = dict(feature_size=32, sampling_rate=8000, hop_length=80, n_fft=200, chunk_length=1)
    transformers.WhisperFeatureExtractor(**extractor).save_pretrained(directory)
    check_pretrained(model_cfg, {})
    assert len(pretrained_state(model_cfg)) == len(expected_shapes(ours()))
    transformers.WhisperFeatureExtractor(**{**extractor, "sampling_rate": 16000}).save_pretrained(directory)
    with pytest.raises(PretrainedError) as info:
        check_pretrained(model_cfg, {})
    message = str(info.value)
    assert "preprocessor_config.json does not match our log-mel features: sampling_rate=16000 but " in message
    assert "model.audio_encoder.sample_rate=8000 (override: model.audio_encoder.sample_rate=16000)" in message
    assert "\n" not in message
    with pytest.raises(PretrainedError, match="sampling_rate=16000 but model.audio_encoder.sample_rate=8000"):
        pretrained_state(model_cfg)


# The encoders of openai/whisper-base and openai/whisper-large-v3 (their published config.json values).
PUBLISHED = {
    "whisper_base": dict(d_model=512, encoder_layers=6, encoder_attention_heads=8, encoder_ffn_dim=2048,
                         num_mel_bins=80, max_source_positions=1500),
    "whisper_large_v3": dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                             num_mel_bins=128, max_source_positions=1500),
}  # fmt: skip
COUNTS = {"whisper_base": 20_590_592, "whisper_large_v3": 636_968_960}  # the presets' comments


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_match_the_published_encoders(preset):
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    audio = compose([f"model/audio_encoder={preset}"]).model.audio_encoder
    config = transformers.WhisperConfig(**PUBLISHED[preset])
    check_config(config.to_dict(), audio)
    with torch.device("meta"):
        theirs = {name: tuple(p.shape) for name, p in WhisperEncoder(config).named_parameters()}
        ours_ = {name: tuple(p.shape) for name, p in AudioEncoder(audio).named_parameters()}
    assert ours_ == expected_shapes(audio)
    names = hf_names("", audio)
    assert {names[name]: shape for name, shape in ours_.items()} == theirs
    assert sum(torch.Size(shape).numel() for shape in theirs.values()) == COUNTS[preset]
    other = "whisper_large_v3" if preset == "whisper_base" else "whisper_base"
    with pytest.raises(PretrainedError, match=f"d_model={PUBLISHED[other]['d_model']} but model.audio_encoder.dim="):
        check_config(transformers.WhisperConfig(**PUBLISHED[other]).to_dict(), audio)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    directory = tmp_path / "decoder_only"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"architectures": ["WhisperForCausalLM"]}))
    for init_from in (str(directory), {"audio_encoder": str(directory)}):
        with pytest.raises(PretrainedError) as info:
            check_pretrained(ModelConfig(audio_encoder=ours(), init_from=init_from), {})
        message = str(info.value)
        assert "architecture 'WhisperForCausalLM' has no importer; supported: " in message and "\n" not in message
        assert all(name in message for name in IMPORTERS)
        assert {"WhisperForConditionalGeneration", "WhisperEncoder", "LlamaForCausalLM"} <= set(IMPORTERS)


def test_missing_and_unplaced_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    directory = save(WhisperEncoder(hf_whisper_config()), tmp_path)
    path = f"{directory}/model.safetensors"
    tensors = load_file(path)
    extra = {**tensors, "layers.0.self_attn.k_proj.bias": torch.zeros(64)}
    save_file(extra, path, metadata={"format": "pt"})
    with pytest.raises(PretrainedError, match=r"1 encoder tensor\(s\) have no place .* e.g. layers.0.self_attn.k_proj"):
        imported(directory, ours())
    del tensors["layers.1.fc2.bias"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(PretrainedError, match=r"tensor layers.1.fc2.bias is missing \(it fills audio_encoder.blocks.1"):
        imported(directory, ours())
    with pytest.raises(PretrainedError, match="model.init_from.audio_encoder: model .* has no audio_encoder"):
        pretrained_state(ModelConfig(init_from=directory))
