"""parallel.rebalance_items against the model and the resolved layout (comm/item_balance.py)."""

from __future__ import annotations

from ..config import Config
from ..parallel.units import ENCODER_UNITS
from .common import _require


def check_item_balance(cfg: Config, layout) -> None:
    """Rebalancing needs an encoder with several data-parallel replicas, each encoding in one stage, and the
    unit engine's view of every replica's items."""
    key = "parallel.rebalance_items=true"
    towers = [name for name in ENCODER_UNITS if getattr(cfg.model, name) is not None]
    _require(
        bool(towers),
        f"{key}: model {cfg.model.name} has no encoder (model.encoder, audio_encoder or video_encoder) whose images, "
        "clips or frames could be rebalanced; set parallel.rebalance_items=false",
    )
    mode = cfg.parallel.mode
    _require(
        mode in ("ddp", "megatron", "manual"),
        f"{key} with parallel.mode={mode}: rebalancing is built for the ddp, megatron and manual layouts (HotSPa "
        "strategies and local-SGD workers encode their own items); set parallel.rebalance_items=false",
    )
    replicas = {name: layout.unit(name) if layout.has_unit(name) else layout.llm for name in towers}
    _require(
        any(unit.dp > 1 for unit in replicas.values()),
        f"{key}: every encoder runs in one data-parallel replica ({', '.join(towers)}: dp=1), so there is nothing "
        "to balance; set parallel.rebalance_items=false",
    )
    _require(
        not layout.trains_with_ddp(),
        f"{key}: torch DDP runs the whole model as one module, with no stage to rebalance in; shard the state "
        "(parallel.shard=zero1, or parallel=zero1)",
    )
    for name, unit in replicas.items():
        _require(
            unit.name == "llm" or unit.pp == 1,
            f"{key}: the {name} unit has pp={unit.pp}; items are rebalanced inside one encoder stage, so use "
            f"parallel.units.{name}.pp=1",
        )
