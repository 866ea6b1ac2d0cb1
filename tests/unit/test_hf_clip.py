"""Hugging Face CLIP vision towers imported into our VisionTransformer give the same features (fp32)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from disttrain_core.config import ModelConfig, VitConfig, compose  # noqa: E402
from disttrain_core.models.hf import PretrainedError, pretrained_state  # noqa: E402
from disttrain_core.models.vit import VisionTransformer, vit_block_count  # noqa: E402
from disttrain_core.validation import ConfigError, validate_model  # noqa: E402

from .hf_helpers import perturbed, save  # noqa: E402

TOL = 1e-5
TINY = dict(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=3)


def hf_vision_config(**overrides):
    values = dict(TINY, num_attention_heads=4, projection_dim=48, hidden_act="quick_gelu", layer_norm_eps=1e-5)
    return transformers.CLIPVisionConfig(**{**values, **overrides})


def ours(**overrides) -> VitConfig:
    values = dict(
        image_size=32, patch_size=8, dim=64, n_layers=3, n_heads=4, mlp_dim=128, output_dim=48, activation="quick_gelu"
    )
    return VitConfig(**{**values, **overrides})


def imported(directory: str, vit: VitConfig) -> VisionTransformer:
    state = pretrained_state(ModelConfig(encoder=vit, init_from=directory))
    assert all(name.startswith("encoder.") for name in state)
    model = VisionTransformer(vit)
    model.load_state_dict({name.removeprefix("encoder."): tensor for name, tensor in state.items()}, strict=True)
    return model.eval()


def images_and_pixels():
    from transformers.utils.constants import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    generator = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=generator)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD))
    return images, (images.float() / 255.0 - mean) / std


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


@pytest.fixture(scope="module")
def with_projection(tmp_path_factory):
    hf = perturbed(transformers.CLIPVisionModelWithProjection(hf_vision_config()))
    return hf, save(hf, tmp_path_factory.mktemp("clip_proj"))


@torch.no_grad()
def test_feature_layer_matches_hidden_states(with_projection):
    hf, directory = with_projection
    vit = ours(feature_layer=-2, output_dim=0)
    model = imported(directory, vit)
    assert len(model.blocks) == vit_block_count(vit) == 2 and model.norm_post is None and model.proj is None
    assert model.out_dim == 64
    images, pixels = images_and_pixels()
    reference = hf(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][:, 1:]
    diff = max_diff(model(images), reference)
    print(f"feature_layer=-2 max abs diff {diff:.2e}")
    assert diff <= TOL


@torch.no_grad()
def test_full_tower_matches_projected_patches(with_projection):
    hf, directory = with_projection
    model = imported(directory, ours())
    assert model.out_dim == 48
    images, pixels = images_and_pixels()
    last = hf.vision_model(pixel_values=pixels).last_hidden_state
    reference = hf.visual_projection(hf.vision_model.post_layernorm(last))[:, 1:]
    diff = max_diff(model(images), reference)
    print(f"feature_layer=None max abs diff {diff:.2e}")
    assert diff <= TOL


@torch.no_grad()
def test_plain_gelu_vision_model_without_projection(tmp_path):
    hf = perturbed(transformers.CLIPVisionModel(hf_vision_config(hidden_act="gelu")))
    directory = save(hf, tmp_path)
    images, pixels = images_and_pixels()
    model = imported(directory, ours(activation="gelu", output_dim=0))
    reference = hf.post_layernorm(hf(pixel_values=pixels).last_hidden_state)[:, 1:]
    assert max_diff(model(images), reference) <= TOL
    with pytest.raises(PretrainedError, match="no visual_projection.*set model.encoder.output_dim=0"):
        imported(directory, ours(activation="gelu"))
    with pytest.raises(PretrainedError, match="hidden_act=gelu but model.encoder.activation=quick_gelu"):
        imported(directory, ours(output_dim=0))


@torch.no_grad()
def test_vision_half_of_clip_model(tmp_path):
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=100)
    config = transformers.CLIPConfig(vision_config=hf_vision_config().to_dict(), text_config=text, projection_dim=40)
    hf = perturbed(transformers.CLIPModel(config))
    directory = save(hf, tmp_path)
    images, pixels = images_and_pixels()
    model = imported(directory, ours(output_dim=40))  # the top-level projection_dim, not vision_config's 48
    last = hf.vision_model(pixel_values=pixels).last_hidden_state
    reference = hf.visual_projection(hf.vision_model.post_layernorm(last))[:, 1:]
    assert max_diff(model(images), reference) <= TOL
    model = imported(directory, ours(feature_layer=1, output_dim=0))
    reference = hf.vision_model(pixel_values=pixels, output_hidden_states=True).hidden_states[1][:, 1:]
    assert max_diff(model(images), reference) <= TOL


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(dim=96, n_heads=4), "Hugging Face hidden_size=64 but model.encoder.dim=96; set model.encoder.dim=64"),
        (dict(output_dim=32), "projection_dim=48 but model.encoder.output_dim=32; set model.encoder.output_dim=48"),
        (dict(n_layers=4), "num_hidden_layers=3 but model.encoder.n_layers=4; set model.encoder.n_layers=3"),
        (dict(n_layers=5, feature_layer=4), "num_hidden_layers=3 but model.encoder.feature_layer=4 needs 4 blocks"),
        (dict(norm_eps=1e-6), "layer_norm_eps=1e-05 but model.encoder.norm_eps=1e-06"),
        (dict(patch_size=4), "patch_size=8 but model.encoder.patch_size=4; set model.encoder.patch_size=8"),
    ],
)
def test_mismatch_names_both_values_and_the_fix(with_projection, overrides, message):
    _, directory = with_projection
    with pytest.raises(PretrainedError, match=message) as info:
        imported(directory, ours(**overrides))
    assert "\n" not in str(info.value)


def test_feature_layer_block_counts_and_validation():
    assert [vit_block_count(ours(n_layers=24, feature_layer=k)) for k in (None, -1, -2, -24, 1, 24)] == [
        24,
        24,
        23,
        1,
        1,
        24,
    ]
    for bad in (0, -25, 25):
        with pytest.raises(ValueError, match=f"feature_layer={bad} is out of range"):
            vit_block_count(ours(n_layers=24, feature_layer=bad))
    cfg = compose(["model.encoder.feature_layer=-99"])
    with pytest.raises(ConfigError, match="model.encoder.feature_layer=-99 is out of range"):
        validate_model(cfg)
    cfg = compose(["model.encoder.activation=relu"])
    with pytest.raises(ConfigError, match="model.encoder.activation='relu' is not known"):
        validate_model(cfg)
    validate_model(compose(["model.encoder.feature_layer=-2", "model.encoder.activation=quick_gelu"]))
