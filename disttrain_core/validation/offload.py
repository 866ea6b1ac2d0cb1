"""Checks of optimizer offload (``parallel.offload``, ``parallel.units.<unit>.offload``; parallel/offload.py) and of
the recompute policies that move or split saved activations (``offload``, ``full_partitioned``:
parallel/saved_activations.py)."""

from __future__ import annotations

from ..config import Config
from ..parallel.units import UNIT_NAMES
from .common import _require

OFFLOAD = ("none", "optimizer")


def validate_offload_settings(cfg: Config) -> None:
    """Names, and the modes and settings offload does not run with, before the layout is resolved."""
    p = cfg.parallel
    settings = [("parallel.offload", p.offload)] + [
        (f"parallel.units.{n}.offload", getattr(p.units, n).offload) for n in UNIT_NAMES
    ]
    for where, value in settings:
        _require(value in OFFLOAD, f"{where}={value!r}: allowed values are {', '.join(OFFLOAD)}")
    used = [where for where, value in settings if value != "none"]
    if not used:
        return
    _require(
        p.mode != "manual" or p.offload == "none",
        "parallel.offload sets ddp and megatron layouts; this layout has units: set parallel.units.<unit>.offload",
    )
    _require(
        p.mode not in ("hotspa", "local_sgd"),
        f"{used[0]}=optimizer with parallel.mode={p.mode}: not built (its layouts are built per bucket or per "
        "worker); use parallel.offload=none",
    )
    _require(
        cfg.trainer.sync_debug == "off",
        f"{used[0]}=optimizer steps on the host, which must wait for the device's gradients every step: drop "
        f"trainer.sync_debug={cfg.trainer.sync_debug} (it flags that wait)",
    )


def check_unit_offload(unit, key: str) -> None:
    """A resolved unit's offload against its shard mode and sizes (``key``: the setting that sets it)."""
    if unit.offload == "none":
        return
    where = f"the {unit.name} unit ({key}=optimizer, shard={unit.shard})"
    _require(
        unit.shard != "none",
        f"{where}: offload moves sharded optimizer state to the host; DDP (shard=none) keeps whole state on every "
        "rank: use parallel.shard=zero1 (ZeRO-Offload) or zero2/zero3 (FSDP2's CPUOffloadPolicy)",
    )
    _require(
        not (unit.fsdp and unit.tp > 1),
        f"{where}: FSDP2's CPU offload with tensor parallelism (tp={unit.tp}) is not built; use shard=zero1 "
        "(its offload works with TP) or tp=1",
    )
    _require(
        unit.ep == 1,
        f"{where}: the expert-parallel experts' own optimizer stays on the device; offload with ep={unit.ep} is "
        "not built: use ep=1 or offload=none",
    )


def check_unit_saved_activations(cfg: Config, unit, key: str) -> None:
    """A resolved unit's ``recompute=offload`` / ``full_partitioned`` against its sizes and the other settings
    (``key``: the setting that sets the policy)."""
    policy = unit.recompute
    if policy not in ("offload", "full_partitioned"):
        return
    where = f"the {unit.name} unit ({key}={policy})"
    _require(
        not cfg.trainer.compile,
        f"{where}: its saved-tensor hooks inside compiled blocks are not built; set trainer.compile=false or use "
        "recompute=full",
    )
    if policy == "full_partitioned":
        _require(
            unit.tp > 1,
            f"{where}: splits each block's kept input over the tensor-parallel group, and tp=1 has none; use "
            "recompute=full",
        )
        _require(
            not cfg.parallel.sequence_parallel,
            f"{where}: sequence parallelism already splits each block's input over the TP group; use recompute=full "
            "(or parallel.sequence_parallel=false)",
        )
