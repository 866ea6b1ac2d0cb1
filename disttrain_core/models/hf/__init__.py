"""Pretrained weights in Hugging Face formats (safetensors), imported by parameter name.

``model.init_from`` names a directory holding ``config.json`` (transformers) or a diffusers config plus
``*.safetensors`` (one file or an index of shards), or a mapping part -> directory. The directory's
architecture (``architectures[0]`` in transformers configs, ``_class_name`` in diffusers configs) picks the
importer, and the importer picks the model part it fills::

    LlamaForCausalLM                 -> llm            (models/hf/llama.py)
    CLIPVisionModel                  -> encoder        (models/hf/clip.py)
    UNet2DConditionModel             -> generator      (models/hf/unet.py)
    WhisperForConditionalGeneration  -> audio_encoder  (models/hf/whisper.py)

An importer reads the Hugging Face tensors, checks the Hugging Face config against ours (a mismatch names
both values), and returns full tensors keyed by *our* parameter names relative to the part
(``layers.0.attention.wq.weight`` for the llm). :func:`pretrained_state` prefixes the part. Nothing here is
unpickled: safetensors holds raw tensors only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...config import ModelConfig

Importer = Callable[[Path, dict, ModelConfig], dict[str, torch.Tensor]]
Checker = Callable[[Path, dict, ModelConfig], None]


@dataclass(frozen=True)
class ImporterEntry:
    part: str  # the MultimodalLLM attribute it fills
    load: Importer
    check: Checker | None = None  # the config comparison alone (no tensors read): run before launch


IMPORTERS: dict[str, ImporterEntry] = {}


def register_importer(architecture: str, part: str, load: Importer, check: Checker | None = None) -> None:
    IMPORTERS[architecture] = ImporterEntry(part, load, check)


class PretrainedError(ValueError):
    """A pretrained-weights directory that cannot be imported into this model (one-line message)."""


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise PretrainedError(f"{directory}: no config.json; model.init_from wants a Hugging Face model directory")
    return json.loads(path.read_text())


def architecture_of(config: dict[str, Any]) -> str:
    if config.get("_class_name"):
        return str(config["_class_name"])
    architectures = config.get("architectures") or []
    if architectures:
        return str(architectures[0])
    return str(config.get("model_type", "unknown"))


def weight_files(directory: str | Path) -> list[Path]:
    """The directory's ``*.safetensors`` files, shards included; variants saved beside the main weights
    (diffusers' ``diffusion_pytorch_model.fp16.safetensors``) are left out when the main ones exist."""
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise PretrainedError(f"{directory}: no *.safetensors files (convert .bin weights to safetensors first)")
    main = [f for f in files if "." not in f.name[: -len(".safetensors")]]
    if main:
        return main
    variants = {f.name[: -len(".safetensors")].split("-0")[0].split(".", 1)[1] for f in files}
    if len(variants) > 1:
        raise PretrainedError(f"{directory}: weights in several variants {sorted(variants)}; keep one")
    return files


def read_safetensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's weight files (:func:`weight_files`)."""
    from safetensors.torch import load_file

    files = weight_files(directory)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file), device="cpu"))
    return tensors


class SafetensorsFiles(Mapping[str, torch.Tensor]):
    """The directory's ``*.safetensors`` tensors by name, each read from disk when looked up."""

    def __init__(self, directory: str | Path):
        from safetensors import safe_open

        self.directory = Path(directory)
        files = weight_files(directory)
        self._file_of: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                self._file_of.update(dict.fromkeys(handle.keys(), file))

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._file_of[name]), framework="pt", device="cpu") as handle:
            return handle.get_tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def take_tensors(
    directory: Path, files: Mapping[str, torch.Tensor], names: Mapping[str, str], shapes: Mapping[str, tuple], part: str
) -> dict[str, torch.Tensor]:
    """Our tensors by name (``shapes``: name -> shape) from ``files`` by Hugging Face name (``names``: ours ->
    theirs); a missing tensor or a wrong shape is a one-line PretrainedError naming both names."""
    out: dict[str, torch.Tensor] = {}
    for ours, shape in shapes.items():
        theirs = names[ours]
        if theirs not in files:
            raise PretrainedError(f"{directory}: tensor {theirs} is missing (it fills {part}.{ours})")
        tensor = files[theirs]
        if tuple(tensor.shape) != tuple(shape):
            raise PretrainedError(
                f"{directory}: tensor {theirs} has shape {list(tensor.shape)} but {part}.{ours} has {list(shape)}"
            )
        out[ours] = tensor.contiguous()
    return out


def _no_importer(key: str, directory: Path, architecture: str) -> PretrainedError:
    supported = ", ".join(sorted(IMPORTERS))
    return PretrainedError(
        f"{key}={directory}: architecture {architecture!r} has no importer; supported: {supported} "
        "(point it at a directory of one of these)"
    )


def _sources(cfg: ModelConfig) -> dict[str, Path]:
    """``model.init_from`` as part -> directory."""
    from omegaconf import DictConfig, OmegaConf

    spec = cfg.init_from
    if isinstance(spec, DictConfig):
        spec = OmegaConf.to_container(spec)
    if spec is None or spec == "":
        return {}
    if isinstance(spec, dict):
        return {str(part): Path(str(path)) for part, path in spec.items()}
    directory = Path(str(spec))
    architecture = architecture_of(read_hf_config(directory))
    if architecture not in IMPORTERS:
        raise _no_importer("model.init_from", directory, architecture)
    return {IMPORTERS[architecture].part: directory}


def _entries(cfg: ModelConfig) -> list[tuple[str, Path, dict, ImporterEntry]]:
    _register_builtin()
    entries = []
    for part, directory in _sources(cfg).items():
        config = read_hf_config(directory)
        architecture = architecture_of(config)
        entry = IMPORTERS.get(architecture)
        if entry is None:
            raise _no_importer(f"model.init_from.{part}", directory, architecture)
        if entry.part != part:
            raise PretrainedError(
                f"model.init_from.{part}={directory} holds a {architecture}, which fills model part {entry.part!r}"
            )
        if part != "llm" and getattr(cfg, part, None) is None:
            raise PretrainedError(f"model.init_from.{part}: model {cfg.name} has no {part}")
        entries.append((part, directory, config, entry))
    return entries


def check_pretrained(cfg: ModelConfig, parts: dict[str, int]) -> None:
    """Before launch: every ``model.init_from`` directory exists, has an importer and a config that matches
    ours; with ``model.init_from_strict`` every model part (``parts``: name -> parameter count) is covered."""
    covered = set()
    for part, directory, config, entry in _entries(cfg):
        if entry.check is not None:
            entry.check(directory, config, cfg)
        covered.add(part)
    left = {part: count for part, count in parts.items() if part not in covered and count > 0}
    if covered and left and cfg.init_from_strict:
        listed = ", ".join(f"{part} ({count:,} parameters)" for part, count in left.items())
        raise PretrainedError(
            f"model.init_from covers {', '.join(sorted(covered))}; {listed} would start from a random "
            "initialization: import them too, or set model.init_from_strict=false to train them from scratch"
        )


def pretrained_state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full tensors by our parameter name (``llm.layers.0...``) from ``model.init_from``."""
    state: dict[str, torch.Tensor] = {}
    for part, directory, config, entry in _entries(cfg):
        for name, tensor in entry.load(directory, config, cfg).items():
            state[f"{part}.{name}"] = tensor
    return state


def load_pretrained(modules: list, cfg: ModelConfig, model_names: list[str]) -> list[str]:
    """Copy ``model.init_from``'s tensors into the parameters of ``modules`` -- this rank's block of each
    (TP, FSDP2) -- before any optimizer copies them. ``model_names``: every parameter of the whole model.
    Returns the names not covered; with ``model.init_from_strict`` any is an error that lists them.

    Every rank reads the whole of each imported part (the importers return full tensors)."""
    from ...base.dtensor import local_block

    state = pretrained_state(cfg)
    names = set(model_names)
    unknown = sorted(set(state) - names)
    if unknown:
        raise PretrainedError(f"model.init_from gives {len(unknown)} tensor(s) this model lacks, e.g. {unknown[0]}")
    missing = [name for name in model_names if name not in state]
    if missing and cfg.init_from_strict:
        raise PretrainedError(
            f"model.init_from leaves {len(missing)} parameter(s) at their random initialization: "
            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; import them too, or set "
            "model.init_from_strict=false"
        )
    with torch.no_grad():
        for module in modules:
            for name, param in module.named_parameters():
                if name not in state:
                    continue
                source = state[name]
                if tuple(source.shape) != tuple(param.shape):
                    raise PretrainedError(f"{name}: imported shape {tuple(source.shape)}, model {tuple(param.shape)}")
                block, offset = local_block(param)
                index = tuple(slice(o, o + n) for o, n in zip(offset, block.shape, strict=True))
                block.copy_(source[index].to(device=block.device, dtype=block.dtype))
    return missing


_REGISTERED = False


def _register_builtin() -> None:
    """Import the importer modules present (each calls :func:`register_importer`)."""
    global _REGISTERED
    if _REGISTERED:
        return
    import importlib

    for module in ("llama", "clip", "unet", "whisper"):
        try:
            importlib.import_module(f"{__name__}.{module}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{module}":
                raise
    _REGISTERED = True
