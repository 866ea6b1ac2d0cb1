"""What every check uses: the error type, the helper that raises it, and how the accelerator, backend
and world size resolve from a config."""

from __future__ import annotations

from ..config import Config
from ..config import resolve_accelerator as resolve_accelerator  # re-exported: validation's callers use them
from ..config import resolve_backend as resolve_backend


class ConfigError(ValueError):
    """A configuration mistake; the message is one actionable line."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def externally_launched() -> bool:
    """True when torchrun, srun or train.py itself created this process, or a scheduler gives the node's
    rendezvous (srun with one task per node): the local machine's devices and a rendezvous in the
    environment are not this process's business (base/launch_env.py)."""
    from ..base.launch_env import LaunchError, detect

    try:
        return detect().kind in ("torchrun", "slurm", "node", "spawned")
    except LaunchError:
        return False


def world_size(cfg: Config) -> int:
    return cfg.trainer.devices * cfg.trainer.num_nodes


def check_references(cfg: Config) -> None:
    """Every ``${...}`` outside ``paths`` resolves, to a value of the right shape (a reference to a key that
    does not exist, or a list setting that refers to a number, is a one-line error here instead of a
    traceback from the first check that reads it). ``paths`` is left out: before Hydra runs a job,
    ``paths.output_dir`` cannot resolve yet."""
    from omegaconf import DictConfig
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(cfg, DictConfig):
        return
    try:
        _check_node(cfg, "", skip="paths")
    except OmegaConfBaseException as error:
        where = getattr(error, "full_key", None) or "config"
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConfigError(
            f"{where}: {reason}; fix the ${{...}} reference (`python train.py --cfg job` prints every key)"
        ) from None


def _check_node(node, prefix: str, skip: str = "") -> None:
    """Resolve the ``${...}`` nodes under ``node`` (only those: walking is cheaper than resolving all)."""
    from omegaconf import DictConfig, ListConfig

    keys = range(len(node)) if isinstance(node, ListConfig) else [k for k in node if k != skip]
    for key in keys:
        child = node._get_node(key)
        container = isinstance(child, (DictConfig, ListConfig))
        if child._is_interpolation():
            value = node[key]  # a single value is converted to its setting's type here, or fails
            if container and value is not None:
                _check_shape(child, value, f"{prefix}{key}")
        elif container and not child._is_none() and not child._is_missing():
            _check_node(child, f"{prefix}{key}.")


def _check_shape(child, value, where: str) -> None:
    """A sub-config or list setting whose ``${...}`` resolved to something else (OmegaConf checks the
    types of single values when it resolves them, not of these)."""
    from omegaconf import DictConfig, ListConfig

    if isinstance(child, ListConfig):
        if not isinstance(value, (ListConfig, list, tuple)):
            raise ConfigError(
                f"{where}={value!r}: a list belongs here, but its ${{...}} reference resolves to a "
                f"{type(value).__name__}; fix the reference"
            )
        return
    if not isinstance(value, (DictConfig, dict)):
        raise ConfigError(
            f"{where}={value!r}: a sub-config belongs here, but its ${{...}} reference resolves to a "
            f"{type(value).__name__}; fix the reference"
        )
    declared = _declared_type(child)
    found = _declared_type(value) if isinstance(value, DictConfig) else None
    if declared is not None and found is not declared:
        raise ConfigError(
            f"{where}: a {declared.__name__} belongs here, but its ${{...}} reference resolves to "
            f"{'a ' + found.__name__ if found else 'a plain mapping'}; fix the reference"
        )


def _declared_type(node) -> type | None:
    """The schema dataclass of a sub-config node (None for a plain mapping)."""
    import dataclasses
    import typing

    kind = node._metadata.ref_type
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    kind = args[0] if len(args) == 1 else kind
    if not dataclasses.is_dataclass(kind):
        kind = node._metadata.object_type
    return kind if dataclasses.is_dataclass(kind) else None
