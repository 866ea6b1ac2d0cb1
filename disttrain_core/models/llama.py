"""Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU feed-forward, untied output head; and the family around it (Qwen2's q/k/v
biases, Qwen3's per-head q/k norm and own head width, Mistral's sliding window).
Single-device code only. Rotary
embeddings rotate interleaved pairs (Meta's layout; Hugging Face checkpoints
are permuted on import, models/hf/llama.py).

Layers live in a ModuleDict keyed "0".."L-1" so a pipeline stage can drop the
layers it does not own and keep the same parameter names. Head counts are
derived from tensor shapes at run time (``view(B, S, -1, head_dim)``), so a
tensor-parallel plan that shards the projections needs no change here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LlamaConfig, head_dim_of
from .common import SwiGLU
from .document_attention import document_attention, segments_of
from .head import LMHead, TokenEmbedding
from .moe import MoeFeedForward


@dataclass
class Documents:
    """Where packed documents sit in a batch of rows: ``ids`` [B, S] (the document each position belongs to;
    -1 for padding) and ``positions`` [B, S] (each position's index inside its document, which selects its
    rotary angle). Attention never crosses a document: a query sees the earlier positions of its own
    document only, exactly as if the document ran alone (data/packing.py builds these).

    Under context parallelism each rank holds a slice of the row: ``ids``/``positions`` are then the rank's
    own positions and ``row_ids`` the whole padded row's ids, from which the ring finds the documents of
    every other rank's keys (parallel/context_parallel.py), which keeps the ring's per-batch document runs in
    ``cache``."""

    ids: torch.Tensor
    positions: torch.Tensor
    row_ids: torch.Tensor | None = None
    _segments: list | None = field(default=None, repr=False, compare=False)
    cache: dict = field(default_factory=dict, repr=False, compare=False)  # per-batch state of attention kernels

    def segments(self) -> list[list[tuple[int, int]]]:
        """Each row's runs of one document id, (start, stop): read from ``ids`` once (a host read), then kept for
        every layer of the forward (models/document_attention.py ``varlen``)."""
        if self._segments is None:
            self._segments = segments_of(self.ids)
        return self._segments


def llama3_inv_freq(inv_freq: torch.Tensor, scaling) -> torch.Tensor:
    """Llama-3.1 frequency scaling (Hugging Face ``rope_type: llama3``) of fp32 inverse frequencies.

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` keep their frequency,
    longer than ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``; the band
    between interpolates linearly in ``original_max_position_embeddings / wavelength``.
    """
    factor = float(scaling.factor)
    low, high = float(scaling.low_freq_factor), float(scaling.high_freq_factor)
    context = float(scaling.original_max_position_embeddings)
    wavelength = 2 * math.pi / inv_freq
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    return torch.where((wavelength >= context / high) & (wavelength <= context / low), blended, out)


def rope_table(head_dim: int, max_len: int, theta: float, device=None, scaling=None) -> torch.Tensor:
    """cos/sin table of shape [max_len, head_dim // 2, 2] (fp32).

    ``scaling``: a :class:`~disttrain_core.config.RopeScalingConfig` (or None); only ``rope_type: llama3``.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None:
        if scaling.rope_type != "llama3":
            raise ValueError(f"rope_scaling.rope_type={scaling.rope_type!r} is not supported (only 'llama3')")
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` [B, S, H, D] by the angles in ``table``: [>=S, D/2, 2] shared by
    every row, or [B, S, D/2, 2] per row (packed documents)."""
    seq_len = x.shape[1]
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    if table.dim() == 4:
        cos, sin = table[:, :, None, :, 0], table[:, :, None, :, 1]
    else:
        cos = table[:seq_len, None, :, 0]
        sin = table[:seq_len, None, :, 1]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def window_mask(length: int, window: int, device=None) -> torch.Tensor:
    """[length, length] bool: query i sees key j when ``i - window < j <= i`` (a sliding window, causal)."""
    distance = torch.arange(length, device=device)[:, None] - torch.arange(length, device=device)[None, :]
    return (distance >= 0) & (distance < window)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        bias = bool(getattr(cfg, "qkv_bias", False))
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        # Qwen3: each head's q and k normalized over head_dim before the rotation (one weight shared by the heads)
        self.q_norm = self.k_norm = None
        if getattr(cfg, "qk_norm", False):
            self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps)
        self.window = getattr(cfg, "sliding_window", None)
        self.document_kernel = "varlen"  # packed documents: model.document_attention (models/document_attention.py)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, documents: Documents | None = None, cache=None
    ) -> torch.Tensor:
        return self.wo(self.attend(self.wq(x), self.wk(x), self.wv(x), rope, documents, cache))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: torch.Tensor,
        documents: Documents | None = None,
        cache=None,
    ) -> torch.Tensor:
        """Causal attention of projected ``[B, S, heads * head_dim]`` q/k/v (any local head count). With
        ``cache`` (a models/generation.py ``LayerCache``: generation) the new keys and values are appended to
        the earlier positions' and the queries attend to all of them."""
        batch, seq_len, _ = q.shape
        q, k, v = (t.view(batch, seq_len, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            return cache.attend(q, k, v).transpose(1, 2).reshape(batch, seq_len, -1)
        return self.core_attention(q, k, v, documents).transpose(1, 2).reshape(batch, seq_len, -1)

    def core_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        """Causal attention of [B, heads, S, head_dim] tensors (k/v may have fewer heads), inside each document
        when ``documents`` is given. Context parallelism replaces it per module with ring attention over the
        sequence slices (parallel/context_parallel.py)."""
        gqa = q.shape[1] != k.shape[1]
        if self.window is not None and q.shape[2] > self.window:  # validation refuses documents and CP with it
            mask = window_mask(q.shape[2], self.window, q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        if documents is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return document_attention(self.document_kernel, q, k, v, documents, gqa)


class DecoderBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        if getattr(cfg, "moe", None) is not None:
            self.feed_forward = MoeFeedForward(cfg.dim, cfg.moe, cfg.ffn_dim)
        else:
            self.feed_forward = SwiGLU(cfg.dim, cfg.ffn_dim)
        # Sequence parallelism (parallel/tensor_parallel.py): a comm/sequence_split.py ``SequenceSplit``; the
        # block then takes and returns this rank's rows of the residual stream, and its row-parallel layers
        # (and a MoE layer's experts) return partial sums.
        self.sequence = None

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, documents: Documents | None = None, cache=None
    ) -> torch.Tensor:
        seq = self.sequence
        if seq is None:
            h = x + self.attention(self.attention_norm(x), rope, documents, cache)
            return h + self.feed_forward(self.ffn_norm(h))
        if cache is not None:
            raise ValueError("generation runs on a whole model (train/sampling.py), not a sequence-parallel one")
        h = x + seq.reduce_scatter(self.attention(seq.gather(self.attention_norm(x)), rope, documents))
        # A MoE layer's experts sum their input gradients over the group themselves (models/moe.py)
        moe = isinstance(self.feed_forward, MoeFeedForward)
        return h + seq.reduce_scatter(self.feed_forward(seq.gather(self.ffn_norm(h), partial=not moe)))


class Llama(nn.Module):
    """Decoder-only transformer. ``embed`` -> ``layers`` -> ``norm`` -> ``output``."""

    def __init__(self, cfg: LlamaConfig, max_seq_len: int):
        super().__init__()
        self.cfg = cfg
        self.max_seq_len = max_seq_len
        self.tok_embeddings = TokenEmbedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): DecoderBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = LMHead(cfg.dim, cfg.vocab_size, bias=False)  # a Linear; with labels, the loss (chunked)
        # The sequence positions this module's inputs hold, in order; None: 0, 1, ..., S-1. Context
        # parallelism sets them (each rank holds a permuted slice of every sequence), so the rotary table
        # row i is the angle of the i-th position held and ``apply_rope`` needs no positions argument.
        self.rope_positions: torch.Tensor | None = None
        self.register_buffer("rope", torch.empty(0), persistent=False)
        self.register_buffer("rope_by_position", torch.empty(0), persistent=False)  # row p: position p
        self.sequence = None  # sequence parallelism: the blocks' SequenceSplit (scattered on entry, gathered on exit)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        device = self.rope.device
        head_dim = head_dim_of(self.cfg)
        scaling = getattr(self.cfg, "rope_scaling", None)
        positions = self.rope_positions
        length = self.max_seq_len if positions is None else max(self.max_seq_len, int(positions.max()) + 1)
        table = rope_table(head_dim, length, self.cfg.rope_theta, device, scaling)
        self.rope_by_position = table
        self.rope = table if positions is None else table[positions.to(table.device)]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)

    def run_layers(self, h: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """The decoder blocks; with ``documents`` each position takes the angle of its place in its document
        and attends inside it."""
        if documents is None:
            rope = self.rope
        else:  # positions < max_seq_len: packing never makes a row longer than model.seq_len
            rope = self.rope_by_position[documents.positions.to(self.rope_by_position.device)]
        if self.sequence is not None:
            h = self.sequence.scatter(h)
        for layer in self.layers.values():
            h = layer(h, rope) if documents is None else layer(h, rope, documents)
        return h if self.sequence is None else self.sequence.leave(h)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.output(normed)

    def forward(self, tokens: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        return self.logits(self.final_norm(self.run_layers(self.embed(tokens), documents)))
