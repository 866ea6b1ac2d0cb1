"""Text generation from the LLM backbone: a key/value cache, greedy, temperature and top-p sampling.

With the cache (``KVCache``) the prompt runs once (the prefill), and each new token then runs one position
through the blocks, its queries attending to the cached keys and values of every earlier position: the work
per token is the blocks' matmuls on one position plus attention over the prefix, so the time per token stays
nearly flat with position instead of growing with it (``generate(..., cache=False)`` runs the whole prefix
again for each token, the reference the cache is checked against: tests/unit/test_generation.py).

The cache keeps its own rotary table, so generation may run past ``model.seq_len`` (positions the model never
trained on: tools/generate.py warns). One process, the whole model: a checkpoint is read into it by name
(tools/generate.py) or, during training, rank 0's model is used as it is (train/sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import head_dim_of
from .llama import Llama, rope_table


class LayerCache:
    """One block's keys and values [B, kv_heads, max_len, head_dim], filled up to ``length``."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.keys = self.values = None
        self.length = 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append ``k``/``v`` [B, Hk, T, D] at the next positions; the attention of ``q`` [B, H, T, D] (causal
        among the T new positions, all earlier positions visible)."""
        if self.keys is None:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.keys = k.new_empty(shape)
            self.values = v.new_empty(shape)
        start, stop = self.length, self.length + k.shape[2]
        if stop > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; position {stop - 1} does not fit")
        self.keys[:, :, start:stop] = k
        self.values[:, :, start:stop] = v
        self.length = stop
        keys, values = self.keys[:, :, :stop], self.values[:, :, :stop]
        gqa = q.shape[1] != k.shape[1]
        new = q.shape[2]
        if new == 1 or start == 0:  # one query sees everything; a prefill is plain causal attention
            return F.scaled_dot_product_attention(q, keys, values, is_causal=new > 1, enable_gqa=gqa)
        # several new positions after earlier ones: query i sees positions < start + i + 1
        rows = torch.arange(start, stop, device=q.device)[:, None]
        mask = torch.arange(stop, device=q.device)[None, :] <= rows
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)


class KVCache:
    """The cache of every block of ``llm``, for rows of up to ``max_len`` positions."""

    def __init__(self, llm: Llama, max_len: int):
        self.layers = [LayerCache(max_len) for _ in llm.layers]
        self.rope = _rope(llm, max_len, llm.tok_embeddings.weight.device)
        self.position = 0

    def forward(self, llm: Llama, tokens: torch.Tensor) -> torch.Tensor:
        """Run ``tokens`` [B, T] (the positions after those cached) through ``llm``; the normed final states of
        the last position [B, D]."""
        stop = self.position + tokens.shape[1]
        rope = self.rope[self.position : stop]
        h = llm.embed(tokens)
        for layer, cache in zip(llm.layers.values(), self.layers, strict=True):
            h = layer(h, rope, None, cache)
        self.position = stop
        return llm.final_norm(h[:, -1])


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: ``temperature`` 0 is greedy (the most likely token); otherwise the
    softmax of logits / temperature, restricted to the smallest set of tokens whose probability reaches
    ``top_p`` (nucleus sampling; 1.0 keeps all), drawn with a seeded generator."""

    temperature: float = 0.0
    top_p: float = 1.0

    def check(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: use 0 (greedy) or a positive temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p}: use a probability in (0, 1] (1 keeps every token)")

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """The next token of each row of ``logits`` [B, V]: [B]."""
        if self.temperature == 0.0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        ordered, order = probs.sort(dim=-1, descending=True)
        # keep a token while the tokens more likely than it have not reached top_p yet (the first always stays)
        ordered = ordered.masked_fill(ordered.cumsum(dim=-1) - ordered >= self.top_p, 0.0)
        picked = torch.multinomial(ordered, 1, generator=generator)
        return order.gather(-1, picked).squeeze(-1)


@torch.no_grad()
def generate(
    llm: Llama,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_id: int | None = None,
    seed: int = 0,
    cache: bool = True,
) -> torch.Tensor:
    """Continue each row of ``prompt`` [B, P] by up to ``max_new_tokens`` tokens: [B, P + n]. A row that has
    produced ``eos_id`` continues with ``eos_id``; generation stops once every row has. ``cache=False``
    recomputes the whole prefix for every token (the reference)."""
    sampling.check()
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    rows = prompt
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    kv = KVCache(llm, prompt.shape[1] + max_new_tokens) if cache else None
    step_input = prompt
    for _ in range(max_new_tokens):
        if kv is not None:
            hidden = kv.forward(llm, step_input)
        else:
            hidden = _uncached_last(llm, rows)
        token = sampling.choose(llm.logits(hidden).float(), generator)
        if eos_id is not None:
            token = torch.where(done, torch.full_like(token, eos_id), token)
            done |= token == eos_id
        rows = torch.cat([rows, token[:, None]], dim=1)
        step_input = token[:, None]
        if eos_id is not None and bool(done.all()):
            break
    return rows


def _uncached_last(llm: Llama, rows: torch.Tensor) -> torch.Tensor:
    """The normed final state of the last position, the whole row run again (its own rotary table, so rows may
    run past model.seq_len as the cache's do)."""
    cfg = llm.cfg
    rope = rope_table(head_dim_of(cfg), rows.shape[1], cfg.rope_theta, rows.device, getattr(cfg, "rope_scaling", None))
    h = llm.embed(rows)
    for layer in llm.layers.values():
        h = layer(h, rope)
    return llm.final_norm(h[:, -1])


def _rope(llm: Llama, length: int, device) -> torch.Tensor:
    """The rotary table of ``llm`` for ``length`` positions (rows past model.seq_len included)."""
    cfg = llm.cfg
    return rope_table(head_dim_of(cfg), length, cfg.rope_theta, device, getattr(cfg, "rope_scaling", None))
