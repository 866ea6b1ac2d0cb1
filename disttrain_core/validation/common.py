"""What every check uses: the error type, the helper that raises it, and how the accelerator, backend
and world size resolve from a config."""

from __future__ import annotations

import os

from ..config import Config

CPU_PROCESSES_PER_CORE = 4  # beyond this, oversubscription is surely a typo, not a test setup


class ConfigError(ValueError):
    """A configuration mistake; the message is one actionable line."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def externally_launched() -> bool:
    """True when torchrun, SLURM or a parent launcher already created the processes."""
    if "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def resolve_accelerator(accelerator: str) -> str:
    if accelerator != "auto":
        return accelerator
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_backend(backend: str, accelerator: str) -> str:
    if backend != "auto":
        return backend
    return "nccl" if accelerator == "cuda" else "gloo"


def world_size(cfg: Config) -> int:
    return cfg.trainer.devices * cfg.trainer.num_nodes
