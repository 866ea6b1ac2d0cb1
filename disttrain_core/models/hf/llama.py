"""Hugging Face ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM``
(safetensors) <-> our :class:`~disttrain_core.models.llama.Llama` (part ``llm``; what each family adds:
models/hf/llama_layout.py).

Names::

    model.embed_tokens.weight                          tok_embeddings.weight
    model.layers.<i>.input_layernorm.weight            layers.<i>.attention_norm.weight
    model.layers.<i>.self_attn.{q,k,v,o}_proj.weight   layers.<i>.attention.{wq,wk,wv,wo}.weight
    model.layers.<i>.post_attention_layernorm.weight   layers.<i>.ffn_norm.weight
    model.layers.<i>.mlp.{gate,down,up}_proj.weight    layers.<i>.feed_forward.{w1,w2,w3}.weight
    model.norm.weight                                  norm.weight
    lm_head.weight                                     output.weight (embed_tokens when tie_word_embeddings)

Hugging Face rotates the halves of each head (``rotate_half``), we rotate interleaved pairs: the rows of
q_proj and k_proj are permuted per head (HF row ``j`` and ``j + head_dim/2`` become our rows ``2j``, ``2j+1``).
Config keys absent from a config.json take transformers' ``LlamaConfig`` defaults. A checkpoint with tied
embeddings (``tie_word_embeddings``) is imported untied: the head starts as a copy of the embedding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ...config import LlamaConfig, ModelConfig, RopeScalingConfig, head_dim_of
from . import PretrainedError, SafetensorsFiles, register_importer
from .llama_layout import (
    FAMILIES,
    Family,
    family_of,
    heads_of,
    hf_to_interleaved,
    interleaved_to_hf,
    shape_of,
    tensor_names,
    tensor_shapes,
)

ARCHITECTURE = "LlamaForCausalLM"
__all__ = ["hf_to_interleaved", "interleaved_to_hf"]  # re-exported: tests and tools import them from here

# Hugging Face config key -> our LlamaConfig field.
CONFIG_KEYS = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "intermediate_size": "ffn_dim",
    "vocab_size": "vocab_size",
    "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
}
# transformers' LlamaConfig defaults (num_key_value_heads defaults to num_attention_heads).
HF_DEFAULTS = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
}
SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _hydra(value: Any) -> str:
    """``value`` as a Hydra override value."""
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_hydra(item)}" for key, item in value.items()) + "}"
    return str(value)


def _rope(hf_config: dict[str, Any], source: str) -> tuple[str, float, dict[str, Any] | None]:
    """(config key holding the rope parameters, rope_theta, llama3 scaling or None), read as transformers does."""
    key = "rope_scaling" if hf_config.get("rope_scaling") or "rope_parameters" not in hf_config else "rope_parameters"
    params = dict(hf_config.get(key) or {})
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", HF_DEFAULTS["rope_theta"])))
    partial = params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise PretrainedError(f"{source}: partial_rotary_factor={partial} is not supported (our rope covers head_dim)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return key, theta, None
    if rope_type != "llama3":
        raise PretrainedError(f"{source}: {key}.rope_type={rope_type!r} is not supported (only default and llama3)")
    if "original_max_position_embeddings" in hf_config:  # transformers gives the top-level key priority
        params["original_max_position_embeddings"] = hf_config["original_max_position_embeddings"]
    params.setdefault(
        "original_max_position_embeddings",
        hf_config.get("max_position_embeddings", HF_DEFAULTS["max_position_embeddings"]),
    )
    missing = [name for name in SCALING_KEYS if name not in params]
    if missing:
        raise PretrainedError(f"{source}: {key} (rope_type llama3) lacks {', '.join(missing)}")
    scaling = {"rope_type": "llama3", **{name: float(params[name]) for name in SCALING_KEYS[:3]}}
    scaling["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    return key, theta, scaling


def _family_values(hf_config: dict[str, Any], family: Family, source: str, dim: int, heads: int) -> dict[str, Any]:
    """Our head_dim, qkv_bias, qk_norm and sliding_window for a config.json of ``family``."""

    def get(key: str) -> Any:
        return hf_config.get(key, HF_DEFAULTS.get(key))

    bias_keys = ("attention_bias", "mlp_bias") if not family.qkv_bias else ("mlp_bias",)
    for key in bias_keys:
        if get(key):
            raise PretrainedError(
                f"{source}: {key}={get(key)} is not supported (o_proj and MLP biases; only Qwen2's q/k/v biases are)"
            )
    head_dim = hf_config.get("head_dim")
    if head_dim is None and dim % heads:
        raise PretrainedError(f"{source}: hidden_size={dim} is not a multiple of num_attention_heads={heads}")
    window = None
    if family.window:
        window = hf_config.get("sliding_window", 4096 if "sliding_window" not in hf_config else None)
    elif hf_config.get("use_sliding_window"):
        raise PretrainedError(
            f"{source}: use_sliding_window=true (a window on some layers) is not supported; ours is Mistral's, on "
            "every layer"
        )
    return {
        "head_dim": None if head_dim in (None, dim // heads) and dim % heads == 0 else int(head_dim),
        "qkv_bias": family.qkv_bias,
        "qk_norm": family.qk_norm,
        "sliding_window": None if window is None else int(window),
    }


def _overrides(hf_config: dict[str, Any], source: str) -> dict[str, Any]:
    def get(key: str) -> Any:
        return hf_config.get(key, HF_DEFAULTS.get(key))

    family = FAMILIES.get((hf_config.get("architectures") or [ARCHITECTURE])[0], FAMILIES[ARCHITECTURE])
    if get("hidden_act") not in (None, "silu"):
        raise PretrainedError(f"{source}: hidden_act={get('hidden_act')!r} is not supported (our SwiGLU uses silu)")
    dim, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    _, theta, scaling = _rope(hf_config, source)
    values = {
        "dim": dim,
        "n_layers": int(get("num_hidden_layers")),
        "n_heads": heads,
        "n_kv_heads": int(hf_config.get("num_key_value_heads") or heads),
        "ffn_dim": int(get("intermediate_size")),
        "vocab_size": int(get("vocab_size")),
        "norm_eps": float(get("rms_norm_eps")),
        "rope_theta": theta,
        "rope_scaling": scaling,
        **_family_values(hf_config, family, source, dim, heads),
    }
    return {f"model.llm.{field}": value for field, value in values.items()}


def llama_overrides(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Our config keys (``model.llm.dim`` ...) and values for a Hugging Face Llama config.json dict.

    ``rope_scaling`` is None or a plain dict of :class:`RopeScalingConfig` fields. Raises :class:`PretrainedError`
    for what our Llama cannot represent (biases, a separate head_dim, other activations or rope types).
    """
    return _overrides(hf_config, "config.json")


def llama_config(hf_config: dict[str, Any]) -> LlamaConfig:
    """Our :class:`LlamaConfig` for a Hugging Face Llama config.json dict."""
    fields = {key.removeprefix("model.llm."): value for key, value in llama_overrides(hf_config).items()}
    if fields["rope_scaling"] is not None:
        fields["rope_scaling"] = RopeScalingConfig(**fields["rope_scaling"])
    return LlamaConfig(**fields)


# our family fields -> how config.json says them (for messages)
FAMILY_KEYS = {
    "head_dim": "head_dim",
    "qkv_bias": "architectures (q/k/v biases)",
    "qk_norm": "architectures (q/k norms)",
    "sliding_window": "sliding_window",
}


def _ours(cfg: LlamaConfig) -> dict[str, Any]:
    """``cfg`` (dataclass or DictConfig) as the values :func:`llama_overrides` returns."""
    values = {field: getattr(cfg, field) for field in CONFIG_KEYS.values()}
    head_dim = getattr(cfg, "head_dim", None)
    values["head_dim"] = None if head_dim in (None, cfg.dim // cfg.n_heads) and cfg.dim % cfg.n_heads == 0 else head_dim
    values["qkv_bias"] = bool(getattr(cfg, "qkv_bias", False))
    values["qk_norm"] = bool(getattr(cfg, "qk_norm", False))
    values["sliding_window"] = getattr(cfg, "sliding_window", None)
    scaling = values["rope_scaling"]
    if scaling is not None:
        values["rope_scaling"] = {
            "rope_type": scaling.rope_type,
            **{key: getattr(scaling, key) for key in SCALING_KEYS},
        }
    return values


def check_config(hf_config: dict[str, Any], cfg: LlamaConfig, source: str = "config.json") -> None:
    """Raise :class:`PretrainedError` (one line: both keys and values, the overrides) unless they match."""
    expected = _overrides(hf_config, source)
    ours = _ours(cfg)
    rope_key = _rope(hf_config, source)[0]
    problems: list[str] = []
    overrides: list[str] = []
    for hf_key, field in [*CONFIG_KEYS.items(), *((label, field) for field, label in FAMILY_KEYS.items())]:
        want, have = expected[f"model.llm.{field}"], ours[field]
        if field == "rope_scaling" and want is not None and have is not None:
            for key in ("rope_type", *SCALING_KEYS):
                if want[key] != have[key]:
                    problems.append(f"{rope_key}.{key}={want[key]} but model.llm.rope_scaling.{key}={have[key]}")
                    overrides.append(f"model.llm.rope_scaling.{key}={_hydra(want[key])}")
        elif field == "rope_scaling" and want != have:
            problems.append(
                f"{rope_key}={_hydra(want)} but model.llm.rope_scaling={_hydra(have)}"
                if want is not None
                else f"{rope_key}.rope_type=default but model.llm.rope_scaling={_hydra(have)}"
            )
            # Hydra cannot merge a dict into a null node; it can merge one into model.llm.
            overrides.append(f"'model.llm={{rope_scaling: {_hydra(want)}}}'" if want else "model.llm.rope_scaling=null")
        elif want != have:
            problems.append(f"{hf_key}={_hydra(want)} but model.llm.{field}={_hydra(have)}")
            overrides.append(f"model.llm.{field}={_hydra(want)}")
    if problems:
        raise PretrainedError(
            f"{source} does not match our config: {'; '.join(problems)} (override: {' '.join(overrides)})"
        )


def import_llama(directory: Path, hf_config: dict[str, Any], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Safetensors of the Llama family -> tensors by our ``llm``-relative names (in the file's dtype)."""
    llm = cfg.llm
    check_config(hf_config, llm, f"{directory}/config.json")
    files = SafetensorsFiles(directory)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    shapes = tensor_shapes(llm)
    state: dict[str, torch.Tensor] = {}
    for ours, hf, which in tensor_names(llm.n_layers, family_of(llm)):
        heads = heads_of(llm, which)
        if ours == "output.weight" and tied:
            state[ours] = state["tok_embeddings.weight"]
            continue
        if hf not in files:
            raise PretrainedError(f"{directory}: tensor {hf} (our llm.{ours}) is missing from its *.safetensors")
        tensor = files[hf]
        if tuple(tensor.shape) != shape_of(ours, shapes):
            raise PretrainedError(
                f"{directory}: tensor {hf} has shape {tuple(tensor.shape)}, llm.{ours} wants {shape_of(ours, shapes)}"
            )
        state[ours] = hf_to_interleaved(tensor, heads).contiguous() if heads else tensor
    return state


def hf_llama_config(cfg: LlamaConfig, max_position_embeddings: int | None = None, **extra: Any) -> dict[str, Any]:
    """A Hugging Face ``LlamaForCausalLM`` config.json dict for ``cfg`` (``extra`` keys are added, e.g. eos_token_id).

    ``max_position_embeddings`` defaults to 8192, or ``original_max_position_embeddings * factor`` with rope scaling.
    """
    ours = _ours(cfg)
    scaling = ours["rope_scaling"]
    if scaling is not None:
        scaling = {
            "rope_type": "llama3",
            "factor": float(scaling["factor"]),
            "low_freq_factor": float(scaling["low_freq_factor"]),
            "high_freq_factor": float(scaling["high_freq_factor"]),
            "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
        }
    if max_position_embeddings is None:
        max_position_embeddings = 8192
        if scaling is not None:
            max_position_embeddings = int(scaling["original_max_position_embeddings"] * scaling["factor"])
    family = family_of(cfg)
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": int(cfg.dim),
        "num_hidden_layers": int(cfg.n_layers),
        "num_attention_heads": int(cfg.n_heads),
        "num_key_value_heads": int(cfg.n_kv_heads),
        "head_dim": head_dim_of(cfg),
        "intermediate_size": int(cfg.ffn_dim),
        "vocab_size": int(cfg.vocab_size),
        "rms_norm_eps": float(cfg.norm_eps),
        "rope_theta": float(cfg.rope_theta),
        "rope_scaling": scaling,
        "max_position_embeddings": int(max_position_embeddings),
        "hidden_act": "silu",
        "attention_bias": False,  # o_proj (and Qwen3 q/k/v) biases: none
        "attention_dropout": 0.0,
        "mlp_bias": False,
        **({"sliding_window": getattr(cfg, "sliding_window", None)} if family.window else {}),
        **({"use_sliding_window": False} if family.model_type.startswith("qwen") else {}),
        "tie_word_embeddings": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    config.update(extra)
    return config


def export_llama(
    state: dict[str, torch.Tensor],
    cfg: LlamaConfig,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    max_position_embeddings: int | None = None,
    **extra: Any,
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (Hugging Face ``LlamaForCausalLM``) into ``out_dir``.

    ``state``: full tensors by our ``llm``-relative names (``llm.``-prefixed names are accepted too); ``dtype``
    casts them (default: kept). ``max_position_embeddings`` and ``extra`` go to :func:`hf_llama_config`.
    """
    from safetensors.torch import save_file

    if "tok_embeddings.weight" not in state and "llm.tok_embeddings.weight" in state:
        state = {name.removeprefix("llm."): tensor for name, tensor in state.items() if name.startswith("llm.")}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(cfg)
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for ours, hf, which in tensor_names(cfg.n_layers, family_of(cfg)):
        heads = heads_of(cfg, which)
        if ours not in state:
            raise KeyError(f"export_llama: state has no {ours}")
        tensor = state[ours].detach().to("cpu", dtype or state[ours].dtype)
        if tuple(tensor.shape) != shape_of(ours, shapes):
            raise ValueError(
                f"export_llama: {ours} has shape {tuple(tensor.shape)}, the config wants {shape_of(ours, shapes)}"
            )
        if heads:
            tensor = interleaved_to_hf(tensor, heads)
        tensor = tensor.contiguous()
        if tensor.untyped_storage().data_ptr() in storages:  # safetensors refuses shared storage (tied weights)
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        tensors[hf] = tensor
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = hf_llama_config(cfg, max_position_embeddings, **extra)
    config["torch_dtype"] = str(tensors["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


for _architecture in FAMILIES:
    register_importer(
        _architecture,
        "llm",
        import_llama,
        lambda directory, hf, cfg: check_config(hf, cfg.llm, f"{directory}/config.json"),
    )
