"""Typed configuration schema.

Every config group under ``conf/`` is merged on top of these dataclasses
(``config/model.py``: the model; ``config/parallel.py``: parallelism; ``config/schema.py``: the rest), so an
unknown key or a value of the wrong type fails while Hydra composes the config,
with a message naming the key. Semantic checks (divisibility, ranges, files on
disk) live in :mod:`disttrain_core.validation`.

Field documentation is the comment after each field (``python train.py --cfg job``
prints the composed values).
"""

from __future__ import annotations

import functools
import os
import pickle
from typing import Any

from .model import (  # noqa: F401  re-exported: ``from disttrain_core.config import LlamaConfig``
    PROJECTOR_KINDS,
    AudioEncoderConfig,
    FreezeConfig,
    LlamaConfig,
    ModelConfig,
    ProjectorConfig,
    RopeScalingConfig,
    UNetConfig,
    VideoEncoderConfig,
    VitConfig,
    head_dim_of,
    image_tokens,
)
from .schema import (  # noqa: F401
    REPO_ROOT,
    CheckpointConfig,
    ClusterConfig,
    CommConfig,
    Config,
    DataConfig,
    LoggerConfig,
    OptimConfig,
    ParallelConfig,
    PathsConfig,
    PlannerConfig,
    ProducerConfig,
    ReorderConfig,
    ScheduleConfig,
    StragglerConfig,
    SyntheticDataConfig,
    TrainerConfig,
    UnitConfig,
    UnitsConfig,
)

CONF_DIR = REPO_ROOT / "conf"
RECIPES_DIR = REPO_ROOT / "recipes"

# The model presets compose these (conf/model/<part>/*.yaml): ``model/encoder=vit_h14`` swaps one module.
MODEL_MODULE_GROUPS = ("model/encoder", "model/audio_encoder", "model/video_encoder", "model/llm", "model/generator")
MODEL_MODULE_GROUPS += ("model/audio_generator",)
# Config groups selectable on the command line (``group=option``).
CONFIG_GROUPS = (
    "model",
    "parallel",
    "schedule",
    "data",
    "optim",
    "trainer",
    "cluster",
    "logger",
    "paths",
    "hparams_search",
    "recipe",
    *MODEL_MODULE_GROUPS,
)


def resolve_accelerator(accelerator: str) -> str:
    """``trainer.accelerator`` with ``auto`` resolved: cuda where a GPU is visible, cpu otherwise."""
    if accelerator != "auto":
        return accelerator
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_backend(backend: str, accelerator: str) -> str:
    """``trainer.backend`` with ``auto`` resolved: nccl on CUDA, gloo elsewhere."""
    if backend != "auto":
        return backend
    return "nccl" if accelerator == "cuda" else "gloo"


def training_precision(precision: str, device_type: str) -> str:
    """``trainer.precision`` with ``auto`` resolved: bf16-mixed on CUDA, 32 elsewhere."""
    if precision != "auto":
        return precision
    return "bf16-mixed" if device_type == "cuda" else "32"


def wire_format(cfg: Any, device_type: str) -> str:
    """What stage boundaries and parameter gathers carry, ``bf16`` or ``fp32``: ``parallel.comm.wire_dtype``,
    where ``auto`` is bf16 under bf16-mixed (the compute rounds to bf16 anyway) and fp32 otherwise."""
    choice = cfg.parallel.comm.wire_dtype
    if choice == "auto":
        return "bf16" if training_precision(cfg.trainer.precision, device_type) == "bf16-mixed" else "fp32"
    return choice


def determinism(choice: Any, device_type: str) -> bool | str:
    """``trainer.deterministic`` resolved: True (strict), False, or "warn" (torch's warn_only)."""
    if choice == "auto":
        return device_type != "cuda"
    return choice


def override_key(arg: str) -> str:
    """The key a Hydra command-line override sets: ``+a.b=1``, ``~a.b`` and ``a.b=1`` all name ``a.b``."""
    return arg.lstrip("+~").split("=", 1)[0]


def group_options(group: str) -> list[str]:
    """Option names available for a config group (yaml files or recipes)."""
    directory = RECIPES_DIR if group == "recipe" else CONF_DIR / group
    if not directory.is_dir():
        return []
    return sorted(p.stem for p in directory.glob("*.yaml"))


_registered = False


def run_stamp(default: str) -> str:
    """The run directory's name: ``default`` (a timestamp), or ``job-<id>`` when a scheduler or torchrun created
    this job's processes, so every process of the job -- each running Hydra -- writes to one directory."""
    from ..base.launch_env import detect

    environment = detect()
    if environment.job_scoped and environment.job_id:
        return f"job-{environment.job_id}"
    return default


def gpus_per_node(accelerator: str, devices: Any) -> Any:
    """The SLURM launcher's ``gpus_per_node``: the node's ranks for a GPU job, none for a CPU recipe (a real
    scheduler refuses a GPU request on nodes without GPUs: "Invalid generic resource (gres) specification")."""
    return None if str(accelerator) == "cpu" else devices


def register_configs() -> None:
    """Store the schema and the recipes in Hydra's ConfigStore (idempotent).

    Recipes live in the top-level ``recipes/`` folder rather than under
    ``conf/`` so that people find them; they are registered as the ``recipe``
    group in the ``_global_`` package, exactly as if they were
    ``conf/recipe/<name>.yaml`` with ``# @package _global_``.
    """
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("run_stamp"):
        OmegaConf.register_new_resolver("run_stamp", run_stamp)
    if not OmegaConf.has_resolver("gpus_per_node"):
        OmegaConf.register_new_resolver("gpus_per_node", gpus_per_node)
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    for name in group_options("recipe"):
        node = OmegaConf.load(RECIPES_DIR / f"{name}.yaml")
        store.store(group="recipe", name=name, node=node, package="_global_")
    _registered = True


@functools.cache
def _schema() -> Any:
    """The schema as an OmegaConf node, built once per process (``OmegaConf.merge`` copies it, never changes it)."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(Config)


def typed_config(container: Any) -> Config:
    """A schema-checked DictConfig (attribute access, types enforced) from a dict or DictConfig."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(_schema(), container)  # type: ignore[return-value]


def compose(overrides: list[str] | None = None, return_hydra_config: bool = False) -> Any:
    """Compose the config outside of ``@hydra.main`` (tools, tests, train.py's argument check).

    Hydra composes the defaults list (the group choices) and then applies the field overrides to the result;
    composing the defaults is most of its ~0.25 s. Here the composed defaults are kept per process, by the group
    choices (``group=option``, ``hydra/launcher=...``), and the field overrides are applied to a copy with
    Hydra's own function: the same config, errors and flags as a fresh composition (tests/unit/test_config.py
    compares them). Overrides that edit the defaults list otherwise (``+``, ``~``, ``++``, ``@package``, sweeps)
    compose afresh."""
    from omegaconf import OmegaConf, open_dict

    overrides = list(overrides or [])
    split = None if return_hydra_config else _split_overrides(overrides)
    if split is None:
        return _hydra_compose(overrides, return_hydra_config)
    choices, fields = split
    if choices not in _COMPOSED:  # with Hydra's own node, which ``hydra.*`` field overrides are checked against
        _COMPOSED[choices] = pickle.dumps(_hydra_compose(list(choices), True))
    cfg = pickle.loads(_COMPOSED[choices])  # a copy the caller may change; 3x faster than a deepcopy
    if fields:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl

        OmegaConf.set_readonly(cfg.hydra, False)  # as Hydra does before it applies the overrides
        ConfigLoaderImpl._apply_overrides_to_config(fields, cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


_COMPOSED: dict[tuple[str, ...], bytes] = {}  # group choices -> the composed config, pickled


def _split_overrides(overrides: list[str]):
    """(the group choices, the parsed field overrides) of ``overrides``, or None where Hydra must compose them
    all (a parse error, an addition or deletion, a package, a sweep)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # Hydra's own composition reports it
        return None
    choices, fields = [], []
    for override in parsed:
        edits = override.is_add() or override.is_delete() or override.is_force_add()
        if edits or override.package is not None or override.is_sweep_override():
            return None
        key = override.key_or_group
        if key in CONFIG_GROUPS or key.startswith("hydra/"):
            choices.append(override.input_line)
        else:
            fields.append(override)
    return tuple(choices), fields


def _hydra_compose(overrides: list[str], return_hydra_config: bool) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=return_hydra_config)


def cpu_count() -> int:
    """Cores this process may use (respects affinity masks and cgroups pinning)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
