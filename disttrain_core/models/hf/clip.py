"""Hugging Face CLIP vision towers -> the ``encoder`` part (models/vit.py).

Accepted architectures: ``CLIPVisionModel`` (no projection), ``CLIPVisionModelWithProjection`` and ``CLIPModel``
(its vision half and ``visual_projection``; the text tower is ignored). Tensor names are found after any prefix
(``vision_model.`` in CLIPModel, WithProjection and transformers-4 CLIPVisionModel checkpoints, none in
transformers-5 CLIPVisionModel ones), so every save format of these classes imports.

Name map (Hugging Face ``<prefix>`` + name -> ours)::

    embeddings.patch_embedding.weight            -> patch_embed.weight
    embeddings.class_embedding                   -> class_embedding
    embeddings.position_embedding.weight         -> positional_embedding
    pre_layrnorm.*                               -> norm_pre.*
    encoder.layers.<i>.layer_norm1 / layer_norm2 -> blocks.<i>.norm1 / norm2
    encoder.layers.<i>.self_attn.{q,k,v}_proj    -> blocks.<i>.attn.{q,k,v}
    encoder.layers.<i>.self_attn.out_proj        -> blocks.<i>.attn.proj
    encoder.layers.<i>.mlp.fc1 / fc2             -> blocks.<i>.mlp.fc1 / fc2
    post_layernorm.*                             -> norm_post.*   (feature_layer null only)
    visual_projection.weight (model root)        -> proj.weight   (feature_layer null and output_dim > 0)

Blocks past ``feature_layer`` are not built, so their tensors are ignored. Hugging Face's CLIP normalizes pixels
in its image processor; ours does it inside the model with the same OpenAI CLIP statistics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...config import ModelConfig, VitConfig
from ..vit import vit_block_count
from . import PretrainedError, architecture_of, read_safetensors, register_importer, take_tensors

ARCHITECTURES = ("CLIPVisionModel", "CLIPVisionModelWithProjection", "CLIPModel")

# transformers' CLIPVisionConfig defaults: a config.json may leave out a value equal to its default.
VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "projection_dim": 512,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}

# Hugging Face hidden_act -> our model.encoder.activation
ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu"}

# Hugging Face name inside an encoder layer -> ours inside blocks.<i>
LAYER_NAMES = {
    "layer_norm1": "norm1",
    "layer_norm2": "norm2",
    "self_attn.q_proj": "attn.q",
    "self_attn.k_proj": "attn.k",
    "self_attn.v_proj": "attn.v",
    "self_attn.out_proj": "attn.proj",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}

ANCHOR = "embeddings.patch_embedding.weight"


def _side(value: Any) -> Any:
    """An image or patch size: an int, or a square [h, w] as one int."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        return int(value[0])
    return value


def vision_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The vision settings with defaults filled: CLIPModel nests them under ``vision_config``."""
    nested = hf_config.get("vision_config")
    values = dict(nested) if isinstance(nested, dict) else dict(hf_config)
    merged = {**VISION_DEFAULTS, **{k: v for k, v in values.items() if v is not None}}
    if isinstance(nested, dict):  # CLIPModel: the projection width is the top-level one
        merged["projection_dim"] = hf_config.get("projection_dim", VISION_DEFAULTS["projection_dim"])
    merged["image_size"], merged["patch_size"] = _side(merged["image_size"]), _side(merged["patch_size"])
    return merged


def check_config(directory: Path, architecture: str, hf: dict[str, Any], vit: VitConfig) -> None:
    """Raise PretrainedError (one line) on the first Hugging Face setting our encoder config contradicts."""

    def mismatch(hf_key: str, hf_value: Any, ours: str, our_value: Any, fix: Any) -> PretrainedError:
        return PretrainedError(
            f"{directory}: Hugging Face {hf_key}={hf_value} but model.encoder.{ours}={our_value}; "
            f"set model.encoder.{ours}={fix}"
        )

    for hf_key, ours in (
        ("hidden_size", "dim"),
        ("num_attention_heads", "n_heads"),
        ("intermediate_size", "mlp_dim"),
        ("image_size", "image_size"),
        ("patch_size", "patch_size"),
        ("num_channels", "channels"),
    ):
        if hf[hf_key] != getattr(vit, ours):
            raise mismatch(hf_key, hf[hf_key], ours, getattr(vit, ours), hf[hf_key])
    if abs(float(hf["layer_norm_eps"]) - vit.norm_eps) > 1e-12:
        raise mismatch("layer_norm_eps", hf["layer_norm_eps"], "norm_eps", vit.norm_eps, hf["layer_norm_eps"])
    act = ACTIVATIONS.get(hf["hidden_act"])
    if act is None:
        raise PretrainedError(
            f"{directory}: Hugging Face hidden_act={hf['hidden_act']} is not supported; "
            f"model.encoder.activation has {sorted(set(ACTIVATIONS.values()))}"
        )
    if act != vit.activation:
        raise mismatch("hidden_act", hf["hidden_act"], "activation", vit.activation, act)
    if not vit.class_token:
        raise PretrainedError(
            f"{directory}: Hugging Face CLIP has a class token but model.encoder.class_token=false; "
            "set model.encoder.class_token=true"
        )
    layers, ours = int(hf["num_hidden_layers"]), vit.n_layers
    layer = vit.feature_layer
    if layer is None or layer < 0:
        # Counted from the end (every block, or a negative feature_layer): the depths must be the same.
        if layers != ours:
            raise mismatch("num_hidden_layers", layers, "n_layers", ours, layers)
    elif vit_block_count(vit) > layers:
        raise PretrainedError(
            f"{directory}: Hugging Face num_hidden_layers={layers} but model.encoder.feature_layer={layer} needs "
            f"{layer} blocks; set model.encoder.feature_layer to at most {layers}"
        )
    if layer is None and vit.output_dim:
        if architecture == "CLIPVisionModel":
            raise PretrainedError(
                f"{directory}: a CLIPVisionModel has no visual_projection but model.encoder.output_dim="
                f"{vit.output_dim}; set model.encoder.output_dim=0 (or model.encoder.feature_layer=-2, LLaVA-style)"
            )
        if int(hf["projection_dim"]) != vit.output_dim:
            raise mismatch("projection_dim", hf["projection_dim"], "output_dim", vit.output_dim, hf["projection_dim"])


def expected_shapes(vit: VitConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of VisionTransformer(vit) with its shape, without building it."""
    d, m = vit.dim, vit.mlp_dim
    tokens = (vit.image_size // vit.patch_size) ** 2 + int(vit.class_token)
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.weight": (d, vit.channels, vit.patch_size, vit.patch_size),
        "class_embedding": (d,),
        "positional_embedding": (tokens, d),
        "norm_pre.weight": (d,),
        "norm_pre.bias": (d,),
    }
    per_block = {"norm1.weight": (d,), "norm2.weight": (d,), "mlp.fc1.weight": (m, d), "mlp.fc2.weight": (d, m)}
    per_block |= {f"attn.{name}.weight": (d, d) for name in ("q", "k", "v", "proj")}
    per_block |= {name[: -len("weight")] + "bias": shape[:1] for name, shape in per_block.items()}
    for i in range(vit_block_count(vit)):
        shapes |= {f"blocks.{i}.{name}": shape for name, shape in per_block.items()}
    if vit.feature_layer is None:
        shapes["norm_post.weight"] = shapes["norm_post.bias"] = (d,)
        if vit.output_dim:
            shapes["proj.weight"] = (vit.output_dim, d)
    return shapes


def hf_names(prefix: str, root: str, vit: VitConfig) -> dict[str, str]:
    """Our parameter name -> the Hugging Face tensor name."""
    names = {
        "patch_embed.weight": prefix + ANCHOR,
        "class_embedding": prefix + "embeddings.class_embedding",
        "positional_embedding": prefix + "embeddings.position_embedding.weight",
        "norm_pre.weight": prefix + "pre_layrnorm.weight",
        "norm_pre.bias": prefix + "pre_layrnorm.bias",
        "norm_post.weight": prefix + "post_layernorm.weight",
        "norm_post.bias": prefix + "post_layernorm.bias",
        "proj.weight": root + "visual_projection.weight",
    }
    for i in range(vit_block_count(vit)):
        for theirs, ours in LAYER_NAMES.items():
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{ours}.{kind}"] = f"{prefix}encoder.layers.{i}.{theirs}.{kind}"
    return names


def _prefix(directory: Path, tensors: dict[str, torch.Tensor]) -> str:
    """The vision tower's prefix: what precedes ``embeddings.patch_embedding.weight``."""
    found = sorted(name[: -len(ANCHOR)] for name in tensors if name.endswith(ANCHOR))
    found = [p for p in found if p == "" or p.endswith(".")]
    if not found:
        raise PretrainedError(f"{directory}: no tensor named *{ANCHOR}; is this a CLIP vision checkpoint?")
    return found[0]


def load_clip_vision(directory: Path, hf_config: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Tensors of the encoder, by our names relative to it, from a Hugging Face CLIP directory."""
    directory = Path(directory)
    vit = cfg.encoder
    if vit is None:
        raise PretrainedError(f"{directory}: a CLIP vision tower fills model.encoder, but this model has none")
    architecture = architecture_of(hf_config)
    check_config(directory, architecture, vision_config(hf_config), vit)
    tensors = read_safetensors(directory)
    prefix = _prefix(directory, tensors)
    root = prefix[: -len("vision_model.")] if prefix.endswith("vision_model.") else prefix
    names = hf_names(prefix, root, vit)
    out = take_tensors(Path(directory), tensors, names, expected_shapes(vit), "encoder")
    return out


def _check(directory: Path, hf_config: dict, cfg: ModelConfig) -> None:
    if cfg.encoder is None:
        raise PretrainedError(f"{directory}: a CLIP vision tower fills model.encoder, but this model has none")
    check_config(Path(directory), architecture_of(hf_config), vision_config(hf_config), cfg.encoder)


for _architecture in ARCHITECTURES:
    register_importer(_architecture, "encoder", load_clip_vision, _check)
