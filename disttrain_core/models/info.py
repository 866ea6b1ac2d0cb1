"""Per-module parameter and FLOP accounting of a model config (built on meta)."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..data.tokenizer import ByteTokenizer
from .common import count_parameters
from .flops import flops_per_sample


def model_info(cfg: ModelConfig) -> dict[str, Any]:
    from . import build_model

    model = build_model(cfg, ByteTokenizer(), device="meta")
    flops = flops_per_sample(cfg)
    modules = {
        name: {
            "params": count_parameters(module),
            "trainable_params": count_parameters(module, trainable_only=True),
            "flops_per_sample": flops.get(name, 0.0),
        }
        for name, module in model.submodules().items()
    }
    return {
        "model": cfg.name,
        "seq_len": cfg.seq_len,
        "images_per_sample": cfg.nominal_images_per_sample if cfg.encoder is not None else 0,
        "image_size": cfg.encoder.image_size if cfg.encoder is not None else None,
        "modules": modules,
        "total_params": sum(m["params"] for m in modules.values()),
        "flops_per_sample": sum(m["flops_per_sample"] for m in modules.values()),
    }


def _human(value: float, unit: str = "") -> str:
    giga = "G" if unit else "B"  # FLOPs: G (giga); parameter counts: B (billion)
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, giga), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{suffix}{unit}"
    return f"{value:.0f}{unit}"


def model_table(cfg: ModelConfig) -> str:
    info = model_info(cfg)
    lines = [
        f"{info['model']}: seq_len={info['seq_len']}, images/sample={info['images_per_sample']}, "
        f"image_size={info['image_size']} (training FLOPs = forward + backward)",
        f"{'module':<22}{'params':>12}{'trainable':>12}{'FLOPs/sample':>16}",
    ]
    for name, module in info["modules"].items():
        lines.append(
            f"{name:<22}{_human(module['params']):>12}{_human(module['trainable_params']):>12}"
            f"{_human(module['flops_per_sample'], 'FLOP'):>16}"
        )
    lines.append(
        f"{'total':<22}{_human(info['total_params']):>12}{'':>12}{_human(info['flops_per_sample'], 'FLOP'):>16}"
    )
    return "\n".join(lines)
