"""The ``sd_vae`` latent encoder against diffusers' AutoencoderKL, on a tiny random VAE saved to disk."""

import json

import pytest
import torch

from disttrain_core.config import compose
from disttrain_core.data.tokenizer import ByteTokenizer
from disttrain_core.models import build_model, materialize
from disttrain_core.models.hf import PretrainedError
from disttrain_core.models.vae import StableDiffusionVAEEncoder

diffusers = pytest.importorskip("diffusers")


def _save_vae(directory, block_out_channels=(16, 32), **config):
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=block_out_channels,
        down_block_types=("DownEncoderBlock2D",) * len(block_out_channels),
        up_block_types=("UpDecoderBlock2D",) * len(block_out_channels),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
        **config,
    )
    with torch.no_grad():  # random init leaves norms at 1/0 and biases small: perturb them so they matter
        for param in vae.parameters():
            param.add_(0.1 * torch.randn_like(param))
    vae.save_pretrained(directory, safe_serialization=True)
    return vae.eval()


def _reference(vae, images):
    with torch.no_grad():
        mean = vae.encode(images.float() / 127.5 - 1.0).latent_dist.mean
    config = vae.config
    if config.latents_mean is not None:
        stats = [torch.tensor(v).view(1, -1, 1, 1) for v in (config.latents_mean, config.latents_std)]
        return (mean - stats[0]) * config.scaling_factor / stats[1]
    return (mean - (config.shift_factor or 0.0)) * config.scaling_factor


# the plain SD layout; another latent normalization without the quant convolutions and the mid-block attention;
# per-channel latent statistics (SDXL/SD3-style configs)
CONFIGS = [
    {},
    {"shift_factor": 0.1, "scaling_factor": 0.5, "use_quant_conv": False, "mid_block_add_attention": False},
    {"latents_mean": [0.1, -0.2, 0.3, 0.0], "latents_std": [0.5, 1.5, 1.0, 2.0]},
]
IMAGES = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("config", CONFIGS)
def test_encoder_matches_diffusers_posterior_mean(tmp_path, config):
    vae = _save_vae(tmp_path, **config)
    ours = StableDiffusionVAEEncoder(tmp_path)
    assert not list(ours.parameters()) and not ours.state_dict()  # frozen buffers only, never saved
    latents = ours(IMAGES)
    assert latents.shape == (2, 4, 16, 16)
    assert (latents - _reference(vae, IMAGES)).abs().max() < 1e-5


def test_legacy_attention_names_load(tmp_path):
    """Older checkpoints name the mid-block attention query/key/value/proj_attn."""
    from safetensors.torch import load_file, save_file

    vae = _save_vae(tmp_path, block_out_channels=(16,))
    file = tmp_path / "diffusion_pytorch_model.safetensors"
    state = load_file(str(file))
    for new, old in (("to_q", "query"), ("to_k", "key"), ("to_v", "value"), ("to_out.0", "proj_attn")):
        for kind in ("weight", "bias"):
            state[f"encoder.mid_block.attentions.0.{old}.{kind}"] = state.pop(
                f"encoder.mid_block.attentions.0.{new}.{kind}"
            )
    save_file(state, str(file))
    assert (StableDiffusionVAEEncoder(tmp_path)(IMAGES) - _reference(vae, IMAGES)).abs().max() < 1e-5


def _tiny(path, *overrides):
    return compose(["model=mllm_tiny", "model.latent_encoder=sd_vae", f"model.latent_encoder_path={path}", *overrides])


def test_meta_built_model_gets_real_vae_weights_after_materialize(tmp_path):
    vae = _save_vae(tmp_path, block_out_channels=(16, 32, 32))  # 4x: mllm_tiny's latent_downsample
    cfg = _tiny(tmp_path).model
    model = build_model(cfg, ByteTokenizer(), device="meta")
    assert all(b.device.type == "meta" for b in model.latent_encoder.buffers())
    materialize(model, "cpu", seed=0, std=cfg.init_std)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the training forward's autocast: the VAE stays fp32
        latents = model.latent_encoder(IMAGES)
    side = cfg.gen_image_size // cfg.latent_downsample
    assert latents.shape == (2, cfg.generator.in_channels, side, side)
    assert (latents - _reference(vae, IMAGES)).abs().max() < 1e-5
    names = [name for name, _ in model.named_parameters()] + list(model.state_dict())
    assert not [name for name in names if name.startswith("latent_encoder")]


def _error(tmp_path, *overrides) -> str:
    with pytest.raises(PretrainedError) as error:
        build_model(_tiny(tmp_path, *overrides).model, ByteTokenizer(), device="meta")
    message = str(error.value)
    assert "\n" not in message
    return message


def test_mismatches_and_missing_path_are_one_line_errors(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"_class_name": "AutoencoderKL", "block_out_channels": [16, 32], "latent_channels": 4})
    )
    message = _error(tmp_path, "model.generator.in_channels=8")
    assert "latent_channels=4" in message and "model.generator.in_channels=8" in message
    message = _error(tmp_path)  # the VAE downsamples 2x, mllm_tiny wants 4x
    assert "downsamples by 2" in message and "model.latent_downsample=4" in message
    with pytest.raises(PretrainedError, match="needs model.latent_encoder_path") as error:
        build_model(compose(["model=mllm_tiny", "model.latent_encoder=sd_vae"]).model, ByteTokenizer(), "meta")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("config", CONFIGS)
def test_decoder_matches_diffusers(tmp_path, config):
    from disttrain_core.models.vae_decoder import StableDiffusionVAEDecoder

    vae = _save_vae(tmp_path, **config)
    ours = StableDiffusionVAEDecoder(tmp_path)
    assert not list(ours.parameters()) and not ours.state_dict()
    latents = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = vae.decode(ours.unscaled(latents)).sample  # what diffusers' pipelines decode
    pixels = ours.pixels(latents)
    assert pixels.shape == (2, 3, 32, 32)
    assert (pixels - expected).abs().max() < 1e-5
    images = ours(latents)
    assert images.dtype == torch.uint8 and torch.equal(images, ((expected.clamp(-1, 1) + 1) * 127.5).round().byte())


def test_images_sampled_through_the_vae_decoder(tmp_path):
    from disttrain_core.models.image_sampling import generate_images

    _save_vae(tmp_path, block_out_channels=(16, 32, 32))  # downsamples by 4: mllm_tiny's latent_downsample
    model = build_model(_tiny(tmp_path).model, ByteTokenizer(), "meta")
    materialize(model, "cpu", seed=0, std=0.02)
    images = generate_images(model.eval(), ByteTokenizer(), ["photo of a red circle"], steps=3)
    assert images.shape == (1, 3, 32, 32) and images.dtype == torch.uint8
    assert images.float().std() > 0  # decoded pixels, not a constant
