"""diffusers UNet2DConditionModel (SD 1.x/2.x layout) imported into our U-Net: same output in fp32."""

from __future__ import annotations

import json

import pytest
import torch

from disttrain_core.config import ModelConfig, UNetConfig
from disttrain_core.models.hf import PretrainedError, pretrained_state
from disttrain_core.models.hf.unet import load_unet
from disttrain_core.models.unet import DiffusionGenerator

diffusers = pytest.importorskip("diffusers")

CHANNELS = [32, 64]


def _save_diffusers(tmp_path, *, linear: bool, layers: int, heads, attention=(True, False), seed: int = 0):
    torch.manual_seed(seed)
    down = tuple("CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attention)
    up = tuple("CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attention))
    model = diffusers.UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=tuple(CHANNELS),
        down_block_types=down,
        up_block_types=up,
        layers_per_block=layers,
        cross_attention_dim=32,
        attention_head_dim=heads,
        norm_num_groups=8,
        use_linear_projection=linear,
    ).eval()
    with torch.no_grad():  # perturb every tensor (norm affines included) so that a swapped name shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


def _config(**generator) -> ModelConfig:
    base = dict(block_out_channels=list(CHANNELS), cross_attention_blocks=[True, False], cross_attention_dim=32)
    return ModelConfig(name="tiny", generator=UNetConfig(**{**base, "norm_groups": 8, **generator}))


@pytest.mark.parametrize(
    "linear, layers, heads, attention, ours",
    [
        # SD 2.x: linear projections, heads = channels // 16 (head_dim 16 everywhere).
        (True, 2, (2, 4), (True, False), dict(head_dim=16, layers_per_block=2)),
        # SD 1.x: 1x1-conv projections, the same number of heads at every level.
        (False, 1, 4, (True, False), dict(attention_heads=[4, 4], layers_per_block=1)),
        (False, 2, 2, (True, True), dict(attention_heads=[2, 2], layers_per_block=2)),
    ],
)
def test_import_matches_diffusers(tmp_path, linear, layers, heads, attention, ours):
    reference = _save_diffusers(tmp_path, linear=linear, layers=layers, heads=heads, attention=attention)
    cfg = _config(cross_attention_blocks=list(attention), **ours)
    state = load_unet(tmp_path, json.loads((tmp_path / "config.json").read_text()), cfg)
    generator = DiffusionGenerator(cfg.generator)
    generator.load_state_dict(state, strict=True)
    generator.eval()

    torch.manual_seed(1)
    sample = torch.randn(2, 4, 8, 8)
    timesteps = torch.tensor([3, 917])
    context = torch.randn(2, 5, 32)
    with torch.no_grad():
        expected = reference(sample, timesteps, encoder_hidden_states=context).sample
        got = generator.unet(sample, timesteps, context)
    diff = (got - expected).abs().max().item()
    print(f"max abs diff linear={linear} layers={layers} heads={heads}: {diff:.3e}")
    assert expected.abs().max() > 0.1  # a real signal, not a zeroed output
    assert diff <= 1e-5


def test_pretrained_state_prefixes_the_generator(tmp_path):
    _save_diffusers(tmp_path, linear=True, layers=1, heads=(2, 4))
    cfg = _config(head_dim=16, layers_per_block=1)
    cfg.init_from = str(tmp_path)
    state = pretrained_state(cfg)
    expected = {f"generator.{name}" for name, _ in DiffusionGenerator(cfg.generator).named_parameters()}
    assert set(state) == expected


def test_mismatches_name_both_values_and_the_override(tmp_path):
    _save_diffusers(tmp_path, linear=True, layers=1, heads=(2, 4))
    config = json.loads((tmp_path / "config.json").read_text())
    good = dict(head_dim=16, layers_per_block=1)
    cases = [
        (config, dict(good, layers_per_block=2), r"layers_per_block=1 but model.generator.layers_per_block=2; "),
        (config, dict(good, head_dim=8), r"override with model.generator.attention_heads=\[2,4\]"),
        (
            config,
            dict(good, cross_attention_blocks=[True, True]),
            r"override with model.generator.cross_attention_blocks=\[true,false\]",
        ),
        (config, dict(good, block_out_channels=[32, 32]), r"block_out_channels=\[32,64\] but .*=\[32,32\]"),
        ({**config, "addition_embed_type": "text"}, good, r"addition_embed_type='text' is not supported"),
        ({**config, "class_embed_type": "timestep"}, good, r"class_embed_type='timestep' is not supported"),
    ]
    for hf_config, ours, pattern in cases:
        with pytest.raises(PretrainedError, match=pattern) as error:
            load_unet(tmp_path, hf_config, _config(**ours))
        assert "\n" not in str(error.value)
    # A tensor that no parameter of ours takes is refused by name.
    from safetensors.torch import load_file, save_file

    path = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file({**load_file(str(path)), "class_embedding.linear_1.weight": torch.zeros(2, 2)}, str(path))
    with pytest.raises(PretrainedError, match=r"class_embedding.linear_1.weight"):
        load_unet(tmp_path, config, _config(**good))
