"""``model.float8`` (parallel/float8.py) before launch: a known recipe, a GPU with FP8 tensor cores, torchao
installed, and no tensor parallelism."""

from __future__ import annotations

from ..config import Config
from .common import _require, resolve_accelerator

_GPUS = "compute capability 8.9 or newer: H100, H200, L40S, RTX 4090"


def check_float8_device(cfg: Config, capability: tuple[int, int] | None = None, gpu: str = "") -> None:
    """The recipe, the accelerator, the GPU's FP8 support (``capability``: read from CUDA when not given) and
    torchao."""
    from ..parallel.float8 import MIN_CAPABILITY, RECIPES

    recipe = cfg.model.float8
    _require(recipe in RECIPES, f"model.float8={recipe!r}: allowed values are {', '.join(RECIPES)}")
    if recipe == "none":
        return
    accelerator = resolve_accelerator(cfg.trainer.accelerator)
    _require(
        accelerator == "cuda",
        f"model.float8={recipe} runs FP8 matmuls on NVIDIA GPUs with FP8 tensor cores ({_GPUS}); this run is on "
        f"{accelerator}: use model.float8=none",
    )
    if capability is None:
        import torch

        if torch.cuda.is_available():
            capability, gpu = torch.cuda.get_device_capability(0), torch.cuda.get_device_name(0)
    if capability is not None:
        _require(
            tuple(capability) >= MIN_CAPABILITY,
            f"model.float8={recipe}: this GPU ({gpu or 'device 0'}, compute capability "
            f"{capability[0]}.{capability[1]}) has no FP8 tensor cores ({_GPUS}); use model.float8=none",
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        _require(False, f"model.float8={recipe} needs torchao: pip install -r requirements.txt (torchao==0.18.0)")


def check_float8_layout(cfg: Config, layout) -> None:
    """No unit of ``layout`` runs tensor parallelism under model.float8."""
    if cfg.model.float8 == "none":
        return
    sharded = [f"{unit.name} tp={unit.tp}" for unit in layout.units if unit.tp > 1]
    _require(
        not sharded,
        f"model.float8={cfg.model.float8} with tensor parallelism ({', '.join(sharded)}) is not built: torchao's "
        "float8 tensor-parallel plans are not wired into parallel/tensor_parallel.py; use tp=1 (parallel.shard="
        "zero3 shards the weights instead, with FP8 all-gathers) or model.float8=none",
    )
