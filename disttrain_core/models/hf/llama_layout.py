"""The Llama family's Hugging Face layouts (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM): what each adds to Llama, their tensors' names and our shapes, and the per-head row order
(models/hf/llama.py imports and exports with these).

Qwen2 adds biases to q, k and v; Qwen3 an RMSNorm over each head's q and k (one weight of head_dim each) and a
head width of its own; Mistral a sliding window. Hugging Face rotates the halves of each head, we rotate
interleaved pairs: every per-head vector that meets the rotation -- q/k rows, their biases, the q/k norm
weights -- is permuted the same way."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import LlamaConfig, head_dim_of


@dataclass(frozen=True)
class Family:
    architecture: str
    model_type: str
    qkv_bias: bool = False  # biases on q_proj, k_proj, v_proj (always, in this family)
    qk_norm: bool = False  # self_attn.q_norm / k_norm
    window: bool = False  # config.json's sliding_window applies to every layer (Mistral)


FAMILIES = {
    family.architecture: family
    for family in (
        Family("LlamaForCausalLM", "llama"),
        Family("MistralForCausalLM", "mistral", window=True),
        Family("Qwen2ForCausalLM", "qwen2", qkv_bias=True),
        Family("Qwen3ForCausalLM", "qwen3", qk_norm=True),
    )
}


def family_of(cfg: LlamaConfig) -> Family:
    """The Hugging Face family that writes ``cfg`` (export): Qwen3 for q/k norms, Qwen2 for q/k/v biases, Mistral
    for a sliding window, else Llama."""
    if getattr(cfg, "qk_norm", False):
        if getattr(cfg, "qkv_bias", False) or getattr(cfg, "sliding_window", None):
            raise ValueError("no Hugging Face family has q/k norms with q/k/v biases or a sliding window")
        return FAMILIES["Qwen3ForCausalLM"]
    if getattr(cfg, "qkv_bias", False):
        if getattr(cfg, "sliding_window", None):
            raise ValueError("Qwen2's sliding window covers some layers only; ours covers every layer")
        return FAMILIES["Qwen2ForCausalLM"]
    return FAMILIES["MistralForCausalLM" if getattr(cfg, "sliding_window", None) else "LlamaForCausalLM"]


def tensor_names(n_layers: int, family: Family) -> list[tuple[str, str, str | None]]:
    """(our name, Hugging Face name, which head count permutes its rows -- ``head`` for a per-head-dim vector --
    or None), in order."""
    names = [("tok_embeddings.weight", "model.embed_tokens.weight", None)]
    for i in range(n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        names += [
            (ours + "attention_norm.weight", hf + "input_layernorm.weight", None),
            (ours + "attention.wq.weight", hf + "self_attn.q_proj.weight", "n_heads"),
            (ours + "attention.wk.weight", hf + "self_attn.k_proj.weight", "n_kv_heads"),
            (ours + "attention.wv.weight", hf + "self_attn.v_proj.weight", None),
        ]
        if family.qkv_bias:
            names += [
                (ours + "attention.wq.bias", hf + "self_attn.q_proj.bias", "n_heads"),
                (ours + "attention.wk.bias", hf + "self_attn.k_proj.bias", "n_kv_heads"),
                (ours + "attention.wv.bias", hf + "self_attn.v_proj.bias", None),
            ]
        if family.qk_norm:
            names += [
                (ours + "attention.q_norm.weight", hf + "self_attn.q_norm.weight", "head"),
                (ours + "attention.k_norm.weight", hf + "self_attn.k_norm.weight", "head"),
            ]
        names += [
            (ours + "attention.wo.weight", hf + "self_attn.o_proj.weight", None),
            (ours + "ffn_norm.weight", hf + "post_attention_layernorm.weight", None),
            (ours + "feed_forward.w1.weight", hf + "mlp.gate_proj.weight", None),
            (ours + "feed_forward.w2.weight", hf + "mlp.down_proj.weight", None),
            (ours + "feed_forward.w3.weight", hf + "mlp.up_proj.weight", None),
        ]
    return names + [("norm.weight", "model.norm.weight", None), ("output.weight", "lm_head.weight", None)]


def tensor_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter shapes by name suffix."""
    dim, head_dim = cfg.dim, head_dim_of(cfg)
    q, kv = cfg.n_heads * head_dim, cfg.n_kv_heads * head_dim
    return {
        "tok_embeddings.weight": (cfg.vocab_size, dim),
        "attention_norm.weight": (dim,),
        "ffn_norm.weight": (dim,),
        "norm.weight": (dim,),
        "attention.wq.weight": (q, dim),
        "attention.wk.weight": (kv, dim),
        "attention.wv.weight": (kv, dim),
        "attention.wq.bias": (q,),
        "attention.wk.bias": (kv,),
        "attention.wv.bias": (kv,),
        "attention.q_norm.weight": (head_dim,),
        "attention.k_norm.weight": (head_dim,),
        "attention.wo.weight": (dim, q),
        "feed_forward.w1.weight": (cfg.ffn_dim, dim),
        "feed_forward.w2.weight": (dim, cfg.ffn_dim),
        "feed_forward.w3.weight": (cfg.ffn_dim, dim),
        "output.weight": (cfg.vocab_size, dim),
    }


def shape_of(name: str, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of the longest suffix of ``name`` in ``shapes`` (``attention.q_norm.weight``, not ``norm.weight``)."""
    return shapes[max((suffix for suffix in shapes if name.endswith(suffix)), key=len)]


def hf_to_interleaved(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k projection rows (or a bias's entries) of each head from Hugging Face's half-split order to
    interleaved pairs."""
    if weight.dim() == 1:
        return hf_to_interleaved(weight[:, None], heads)[:, 0]
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def interleaved_to_hf(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`hf_to_interleaved`."""
    if weight.dim() == 1:
        return interleaved_to_hf(weight[:, None], heads)[:, 0]
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def heads_of(cfg: LlamaConfig, which: str | None) -> int | None:
    """The head count that permutes a tensor's rows (``head``: a per-head vector, one head)."""
    return None if which is None else 1 if which == "head" else int(getattr(cfg, which))
