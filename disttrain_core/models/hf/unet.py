"""diffusers ``UNet2DConditionModel`` (Stable Diffusion 1.x / 2.x layout) -> our generator (models/unet.py).

Names are relative to :class:`~disttrain_core.models.unet.DiffusionGenerator` (``unet.conv_in.weight``).
The diffusers config is checked against ``model.generator`` first; a mismatch names the diffusers key and
value, ours, and the override that fixes it. Features our U-Net does not have (class or added embeddings,
other block types, several transformer layers per block, ...) are refused by name, and so is any tensor
that no parameter of ours takes.

SD 1.x's 1x1-conv transformer projections (``use_linear_projection: false``) become our linear ones (the
same matrix). ``upcast_attention`` (SD 2.1) only matters in fp16: fp32 is exact and bf16 has fp32's range.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ...config import ModelConfig
from . import PretrainedError, read_safetensors, register_importer

_DOWN_TYPES = {"CrossAttnDownBlock2D": True, "DownBlock2D": False}
_UP_TYPES = {"CrossAttnUpBlock2D": True, "UpBlock2D": False}

# diffusers defaults of the keys compared with ours (old SD configs omit keys that have their default).
_DEFAULTS: dict[str, Any] = {
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": [320, 640, 1280, 1280],
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "cross_attention_dim": 1280,
    "attention_head_dim": 8,
    "use_linear_projection": False,
}

# diffusers options our U-Net implements with one value only (the SD 1.x/2.x one, also diffusers' default);
# a per-block list must hold it in every entry. _ALSO: other spellings of the same behaviour.
_FIXED: dict[str, Any] = {
    "center_input_sample": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "only_cross_attention": False,
    "mid_block_only_cross_attention": None,
    "downsample_padding": 1,
    "mid_block_scale_factor": 1.0,
    "dropout": 0.0,
    "act_fn": "silu",
    "norm_eps": 1e-5,
    "transformer_layers_per_block": 1,
    "reverse_transformer_layers_per_block": None,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "num_attention_heads": None,
    "dual_cross_attention": False,
    "class_embed_type": None,
    "num_class_embeds": None,
    "class_embeddings_concat": False,
    "addition_embed_type": None,
    "resnet_time_scale_shift": "default",
    "resnet_skip_time_act": False,
    "resnet_out_scale_factor": 1.0,
    "time_embedding_type": "positional",
    "time_embedding_act_fn": None,
    "timestep_post_act": None,
    "time_cond_proj_dim": None,
    "conv_in_kernel": 3,
    "conv_out_kernel": 3,
    "attention_type": "default",
    "cross_attention_norm": None,
}
_ALSO: dict[str, tuple] = {"mid_block_only_cross_attention": (False,), "act_fn": ("swish",)}


def _hydra(value: Any) -> str:
    """A value as a Hydra override writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra(v) for v in value) + "]"
    return str(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _uniform(directory: Path, key: str, value: Any, levels: int) -> Any:
    """An int-or-per-level-list diffusers value as one value (ours are the same at every level)."""
    if not isinstance(value, (list, tuple)):
        return value
    if len(value) != levels or any(v != value[0] for v in value):
        raise PretrainedError(f"{directory}: diffusers {key}={list(value)} differs per level; our U-Net has one value")
    return value[0]


def _get(hf: dict[str, Any], key: str) -> Any:
    """A diffusers config value, or diffusers' default when the config omits it."""
    return hf.get(key, _DEFAULTS.get(key, _FIXED.get(key)))


def _mismatch(
    directory: Path, key: str, value: Any, ours: str, our_value: Any, override: Any = None
) -> PretrainedError:
    """The error naming a diffusers value, ours, and the override that fixes it."""
    fix = _hydra(value if override is None else override)
    return PretrainedError(
        f"{directory}: diffusers {key}={_hydra(value)} but model.generator.{ours}={_hydra(our_value)}; "
        f"override with model.generator.{ours}={fix}"
    )


def _check_fixed(directory: Path, hf: dict[str, Any]) -> None:
    """The diffusers options our U-Net implements with one value only hold that value."""
    for key, wanted in _FIXED.items():
        value = _get(hf, key)
        values = value if isinstance(value, (list, tuple)) else [value]
        if not all(any(_same(v, w) for w in (wanted, *_ALSO.get(key, ()))) for v in values):
            raise PretrainedError(
                f"{directory}: diffusers {key}={value!r} is not supported (our U-Net implements {key}={wanted!r})"
            )


def _check_channels(directory: Path, hf: dict[str, Any], gen) -> list:
    """The channels per level, the time embedding and the in/out channels; returns the channels per level."""
    chans = list(_get(hf, "block_out_channels"))
    if chans != list(gen.block_out_channels):
        raise _mismatch(directory, "block_out_channels", chans, "block_out_channels", list(gen.block_out_channels))
    if hf.get("time_embedding_dim") not in (None, 4 * chans[0]):
        raise PretrainedError(
            f"{directory}: diffusers time_embedding_dim={hf['time_embedding_dim']} is not supported "
            f"(ours is 4 * block_out_channels[0] = {4 * chans[0]})"
        )
    if _get(hf, "in_channels") != gen.in_channels:
        raise _mismatch(directory, "in_channels", _get(hf, "in_channels"), "in_channels", gen.in_channels)
    if _get(hf, "out_channels") != _get(hf, "in_channels"):
        raise PretrainedError(
            f"{directory}: diffusers out_channels={_get(hf, 'out_channels')} differs from "
            f"in_channels={_get(hf, 'in_channels')}; our generator predicts noise with in_channels channels"
        )
    return chans


def _check_block_types(directory: Path, hf: dict[str, Any], gen, levels: int) -> list[bool]:
    """The down and up block types; returns which levels have cross-attention."""
    down, up = list(_get(hf, "down_block_types")), list(_get(hf, "up_block_types"))
    for key, types, known in (("down_block_types", down, _DOWN_TYPES), ("up_block_types", up, _UP_TYPES)):
        unknown = [t for t in types if t not in known]
        if unknown or len(types) != levels:
            raise PretrainedError(
                f"{directory}: diffusers {key}={types} is not supported: want {levels} entries from {sorted(known)}"
            )
    attention = [_DOWN_TYPES[t] for t in down]
    if [_UP_TYPES[t] for t in up] != attention[::-1]:
        raise PretrainedError(
            f"{directory}: diffusers up_block_types={up} do not mirror down_block_types={down}; our up blocks do"
        )
    if attention != list(gen.cross_attention_blocks):
        raise _mismatch(
            directory, "down_block_types", down, "cross_attention_blocks", list(gen.cross_attention_blocks), attention
        )
    return attention


def _check_block_sizes(directory: Path, hf: dict[str, Any], gen, levels: int) -> None:
    """Layers per block, the GroupNorm groups and the cross-attention context size."""
    layers = _uniform(directory, "layers_per_block", _get(hf, "layers_per_block"), levels)
    if layers != gen.layers_per_block:
        raise _mismatch(directory, "layers_per_block", layers, "layers_per_block", gen.layers_per_block)
    groups = _get(hf, "norm_num_groups")
    if groups is None:
        raise PretrainedError(f"{directory}: diffusers norm_num_groups=None (no output GroupNorm) is not supported")
    if groups != gen.norm_groups:
        raise _mismatch(directory, "norm_num_groups", groups, "norm_groups", gen.norm_groups)
    context = _uniform(directory, "cross_attention_dim", _get(hf, "cross_attention_dim"), levels)
    if context != gen.cross_attention_dim:
        raise _mismatch(directory, "cross_attention_dim", context, "cross_attention_dim", gen.cross_attention_dim)


def _check_heads(directory: Path, hf: dict[str, Any], gen, chans: list, attention: list[bool]) -> None:
    """The attention heads per level where transformers are."""
    from ..unet import level_head_dims

    levels = len(chans)
    # diffusers' attention_head_dim is the number of heads per level (a historical misnomer).
    heads = _get(hf, "attention_head_dim")
    heads = list(heads) if isinstance(heads, (list, tuple)) else [heads] * levels
    valid = [isinstance(h, int) and h > 0 and chans[i] % h == 0 for i, h in enumerate(heads)]
    if len(heads) != levels or not all(valid):
        raise PretrainedError(f"{directory}: diffusers attention_head_dim={heads} does not split {chans} into heads")
    try:
        dims = level_head_dims(gen)
    except ValueError as error:
        raise PretrainedError(f"{directory}: {error}") from None
    # Heads matter where transformers are: the levels with cross-attention, and the middle (last level's).
    used = [i for i in range(levels) if attention[i] or i == levels - 1]
    ours = [c // d if d > 0 and c % d == 0 else None for c, d in zip(chans, dims, strict=True)]
    if any(heads[i] != ours[i] for i in used):
        given = list(getattr(gen, "attention_heads", None) or [])
        raise PretrainedError(
            f"{directory}: diffusers attention_head_dim={_hydra(heads)} (heads per level) but model.generator has "
            f"{_hydra(ours)} heads (head_dim={gen.head_dim}, attention_heads={_hydra(given)})"
            f"; override with model.generator.attention_heads={_hydra(heads)}"
        )


def check_config(directory: Path, hf: dict[str, Any], cfg: ModelConfig) -> None:
    """Raise :class:`PretrainedError` (one line) unless ``hf`` describes the U-Net ``cfg.generator`` builds."""
    gen = cfg.generator
    if gen is None:
        raise PretrainedError(f"{directory}: a UNet2DConditionModel, but model {cfg.name} has no generator")
    _check_fixed(directory, hf)
    chans = _check_channels(directory, hf, gen)
    levels = len(chans)
    attention = _check_block_types(directory, hf, gen, levels)
    _check_block_sizes(directory, hf, gen, levels)
    _check_heads(directory, hf, gen, chans, attention)


_TOP = {
    "conv_in": "conv_in",
    "time_linear1": "time_embedding.linear_1",
    "time_linear2": "time_embedding.linear_2",
    "norm_out": "conv_norm_out",
    "conv_out": "conv_out",
}
_MID = {"mid_res1": ("mid_block.resnets.0", "resnet"), "mid_attn": ("mid_block.attentions.0", "transformer")}
_MID["mid_res2"] = ("mid_block.resnets.1", "resnet")
_RESNET = {"skip": "conv_shortcut"}  # norm1, conv1, time_emb_proj, norm2, conv2 keep their names
_TRANSFORMER = {  # norm, proj_in, proj_out keep their names
    "norm1": "transformer_blocks.0.norm1",
    "attn1.to_q": "transformer_blocks.0.attn1.to_q",
    "attn1.to_k": "transformer_blocks.0.attn1.to_k",
    "attn1.to_v": "transformer_blocks.0.attn1.to_v",
    "attn1.to_out": "transformer_blocks.0.attn1.to_out.0",
    "norm2": "transformer_blocks.0.norm2",
    "attn2.to_q": "transformer_blocks.0.attn2.to_q",
    "attn2.to_k": "transformer_blocks.0.attn2.to_k",
    "attn2.to_v": "transformer_blocks.0.attn2.to_v",
    "attn2.to_out": "transformer_blocks.0.attn2.to_out.0",
    "norm3": "transformer_blocks.0.norm3",
    "ff.proj": "transformer_blocks.0.ff.net.0.proj",  # the first half of diffusers' fused GEGLU projection
    "ff.gate": "transformer_blocks.0.ff.net.0.proj",  # and the second (_HALVES)
    "ff.out": "transformer_blocks.0.ff.net.2",
}


_HALVES = {"ff.proj": 0, "ff.gate": 1}  # rows of diffusers' [2 hidden, dim] GEGLU projection


def diffusers_name(ours: str) -> str:
    """The diffusers tensor name of our generator parameter ``ours`` (``unet.down.0.resnets.1.skip.weight``)."""
    parts = ours.split(".")
    if parts[0] != "unet" or len(parts) < 3:
        raise KeyError(ours)
    path, leaf = parts[1:-1], parts[-1]
    if path[0] in ("down", "up"):
        block = f"{path[0]}_blocks.{path[1]}"
        if path[2] == "resample":
            return f"{block}.{path[0]}samplers.0.conv.{leaf}"
        prefix, kind, rest = f"{block}.{path[2]}.{path[3]}", path[2], path[4:]
    elif path[0] in _MID:
        (prefix, kind), rest = _MID[path[0]], path[1:]
    else:
        return f"{_TOP[path[0]]}.{leaf}"
    inner = ".".join(rest)
    table = _RESNET if kind in ("resnets", "resnet") else _TRANSFORMER
    return f"{prefix}.{table.get(inner, inner)}.{leaf}"


def load_unet(directory: Path, hf_config: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from ..unet import DiffusionGenerator

    directory = Path(directory)
    check_config(directory, hf_config, cfg)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in DiffusionGenerator(cfg.generator).named_parameters()}
    tensors = read_safetensors(directory)
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for ours, shape in shapes.items():
        theirs = diffusers_name(ours)
        if theirs not in tensors:
            raise PretrainedError(f"{directory}: no tensor {theirs} (for our generator.{ours})")
        tensor = tensors[theirs]
        used.add(theirs)
        module = ours.rsplit(".", 1)[0]
        half = next((h for key, h in _HALVES.items() if module.endswith(f".{key}")), None)
        if half is not None:
            tensor = tensor.chunk(2, dim=0)[half]
        if tensor.ndim == 4 and len(shape) == 2 and tensor.shape[2:] == (1, 1):  # 1x1-conv projection (SD 1.x)
            tensor = tensor.reshape(tensor.shape[:2])
        if tensor.shape != shape:
            raise PretrainedError(
                f"{directory}: tensor {theirs} has shape {list(tensor.shape)} but our generator.{ours} "
                f"has {list(shape)}"
            )
        state[ours] = tensor
    extra = sorted(set(tensors) - used)
    if extra:
        raise PretrainedError(
            f"{directory}: {len(extra)} diffusers tensors have no place in our U-Net (unsupported features): "
            f"{', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''}"
        )
    return state


register_importer(
    "UNet2DConditionModel", "generator", load_unet, lambda directory, hf, cfg: check_config(Path(directory), hf, cfg)
)
