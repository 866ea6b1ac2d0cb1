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
    """Where rank 0 lacks the whole model, samples come from the checkpoint of each sampling step: one must be
    saved there."""
    from ..train.sampling import samples_in_place

    every, t = cfg.trainer.sample_every_n_steps, cfg.trainer
    if every <= 0 or samples_in_place(cfg, layout):
        return
    saves = t.checkpoint.every_n_steps
    if saves <= 0 or every % saves != 0 or not t.checkpoint.save_last:
        where = f"parallel={cfg.parallel.mode}" if cfg.parallel.mode in ("hotspa", "local_sgd") else "this layout"
        raise ConfigError(
            f"trainer.sample_every_n_steps={every}: {where} spreads the model over the ranks, so rank 0 samples "
            f"from the checkpoint saved at each sampling step; set trainer.checkpoint.every_n_steps={every} (or a "
            "divisor of it) and keep trainer.checkpoint.save_last=true"
        )
