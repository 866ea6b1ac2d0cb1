"""Samples during training (``trainer.sample_every_n_steps``) and the experiment trackers (``logger=``): what
cannot work is refused before launch, in one line."""

from __future__ import annotations

from ..config import Config
from .common import ConfigError


def check_trackers(cfg: Config) -> None:
    """An optional tracker (W&B, MLflow) chosen but not installed."""
    from ..train.trackers import OPTIONAL, missing_trackers

    missing = missing_trackers(cfg.logger)
    if missing:
        packages = " ".join(OPTIONAL[name][1] for name in missing)
        raise ConfigError(
            f"logger={missing[0]} needs the {OPTIONAL[missing[0]][0]} package, which is not installed: "
            f"pip install -e .[trackers] (or pip install {packages})"
        )


def check_sampling(cfg: Config) -> None:
    """Settings that relate to the model: images need a generator with decodable latents, and at most as many
    denoising steps as its schedule has."""
    from ..models.image_sampling import DECODABLE
    from ..train.sampling import sample_images

    s, m = cfg.trainer.samples, cfg.model
    if s.images and m.generator is None:
        raise ConfigError(
            f"trainer.samples.images=true: model {m.name} has no generator to sample images from; use "
            "trainer.samples.images=false (text samples only) or a model with one (model=mllm_tiny)"
        )
    if s.images and m.latent_encoder not in DECODABLE:
        raise ConfigError(
            f"trainer.samples.images=true with model.latent_encoder={m.latent_encoder}: its latents have no decoder "
            f"(only {', '.join(DECODABLE)} latents decode to images); use trainer.samples.images=false"
        )
    if sample_images(cfg) and s.steps > m.generator.num_train_timesteps:
        steps = m.generator.num_train_timesteps
        raise ConfigError(
            f"trainer.samples.steps={s.steps}: the generator's schedule has {steps} timesteps; use at most {steps}"
        )


def check_sampling_layout(cfg: Config, layout) -> None:
    """Samples come from rank 0's model, which must be the whole model: layouts trained by the DDP engine."""
    every = cfg.trainer.sample_every_n_steps
    if every <= 0:
        return
    mode = cfg.parallel.mode
    if mode in ("hotspa", "local_sgd") or not layout.trains_with_ddp():
        where = f"parallel={mode}" if mode in ("hotspa", "local_sgd") else "this layout (sharded, TP, PP or units)"
        raise ConfigError(
            f"trainer.sample_every_n_steps={every}: samples are drawn from rank 0's whole model, which {where} "
            "does not hold; use trainer.sample_every_n_steps=0 and python tools/generate.py path=<run> on a "
            "checkpoint"
        )
