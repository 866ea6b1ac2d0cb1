"""The projectors' settings that relate to each other or to the model (their single bounds: ``numbers``): which
projector may resample, each kind's layer count, and the resampler's heads against its width."""

from __future__ import annotations

from ..config import Config
from .common import _require

# The projectors of the parts present, and the width each one outputs
_PRESENT = {
    "encoder_projector": "encoder",
    "audio_projector": "audio_encoder",
    "video_projector": "video_encoder",
    "generator_projector": "generator",
    "audio_generator_projector": "audio_generator",
}


def validate_projectors(cfg: Config) -> None:
    m = cfg.model
    for name, part in _PRESENT.items():
        if getattr(m, part) is None:
            continue
        projector = getattr(m, name)
        if projector.kind == "mlp":
            _require(
                projector.n_layers in (1, 2),
                f"model.{name}.n_layers={projector.n_layers}: allowed values are 1 and 2 (kind=mlp: one linear, or "
                "linear-GELU-linear)",
            )
            continue
        _require(
            name == "encoder_projector",
            f"model.{name}.kind={projector.kind}: only model.encoder_projector can be a resampler (the data path "
            f"sizes each image's <img> run by its queries; the others keep one position per input); set "
            f"model.{name}.kind=mlp",
        )
        _require(
            m.llm.dim % projector.n_heads == 0,
            f"model.{name}.n_heads={projector.n_heads} does not divide the resampler's width model.llm.dim="
            f"{m.llm.dim}; use a divisor of {m.llm.dim}, e.g. {_divisor_near(m.llm.dim, projector.n_heads)}",
        )


def _divisor_near(width: int, heads: int) -> int:
    """The largest divisor of ``width`` not above ``heads`` (searched among the first 4,096 head counts)."""
    return next(d for d in range(min(width, heads, 4096), 0, -1) if width % d == 0)
