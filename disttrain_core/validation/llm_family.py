"""The LLM's shape and its family's options (models/llama.py): head widths, Qwen3's own head_dim and q/k norm,
Mistral's sliding window against the kernels and layouts that do not apply it."""

from __future__ import annotations

from ..config import Config, head_dim_of
from .common import _require


def validate_llm_shape(cfg: Config) -> None:
    llm = cfg.model.llm
    if llm.head_dim is None:
        _require(
            llm.dim % llm.n_heads == 0,
            f"model.llm.dim={llm.dim} is not divisible by model.llm.n_heads={llm.n_heads}; set model.llm.head_dim "
            "for a head width of its own",
        )
    else:
        _require(llm.head_dim >= 2, f"model.llm.head_dim={llm.head_dim}: use null (dim / n_heads) or at least 2")
    _require(
        llm.n_heads % llm.n_kv_heads == 0,
        f"model.llm.n_heads={llm.n_heads} is not a multiple of model.llm.n_kv_heads={llm.n_kv_heads}",
    )
    _require(head_dim_of(llm) % 2 == 0, f"model.llm head size {head_dim_of(llm)} must be even for rotary embeddings")
    extras = [name for name in ("qkv_bias", "qk_norm") if getattr(llm, name)]
    _require(
        cfg.parallel.mode != "hotspa" or not extras,
        f"parallel.mode=hotspa re-shards plain Llama weights only, not model.llm.{extras[0] if extras else ''}; "
        "use parallel.mode=megatron or a units layout",
    )
    _require(
        not (cfg.parallel.comm.tp_overlap and llm.qkv_bias),
        "parallel.comm.tp_overlap=true runs the q/k/v matmuls without their biases (model.llm.qkv_bias=true); set "
        "parallel.comm.tp_overlap=false",
    )
    window = llm.sliding_window
    if window is None:
        return
    _require(window >= 1, f"model.llm.sliding_window={window}: use null (all earlier positions) or a width >= 1")
    if cfg.model.seq_len <= window:
        return  # every query sees its whole prefix: plain causal attention
    where = f"model.llm.sliding_window={window} < model.seq_len={cfg.model.seq_len}"
    _require(
        not cfg.data.packing.enabled,
        f"{where}: the packed-document kernels do not apply a window; set data.packing.enabled=false or "
        f"model.seq_len<={window}",
    )
    cps = [cfg.parallel.cp, *(getattr(cfg.parallel.units, name).cp for name in ("llm",))]
    _require(
        max(cps) == 1,
        f"{where}: context parallelism's attention does not apply a window; use cp=1 or model.seq_len<={window}",
    )
