"""The LLM's ends: the token embedding and the output head with its loss, each whole or with its vocabulary rows
split over a tensor-parallel group (models/vocab_parallel.py), the head's loss optionally over chunks of positions
(models/chunked_loss.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .chunked_loss import IGNORE, linear_cross_entropy_sum
from .vocab_parallel import local_rows, vocab_parallel_embedding, vocab_parallel_logits, vocab_parallel_loss_sum


class TokenEmbedding(torch.nn.Embedding):
    """The LLM's token embedding (an Embedding: checkpoints and FSDP2 see ``tok_embeddings.weight``); with
    ``vocab_mesh`` set (parallel/tensor_parallel.py), its rows split over that mesh. Called as a module either
    way, so FSDP2's hooks on it gather its weight first."""

    vocab_mesh = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.vocab_mesh is None:
            return super().forward(tokens)
        return vocab_parallel_embedding(tokens, self.weight, self.vocab_mesh)


class LMHead(torch.nn.Linear):
    """The LLM's output projection (a Linear, so checkpoints and tensor/FSDP plans see ``output.weight``); called
    with labels it returns the summed loss, chunked by ``chunk`` positions (0: whole rows, plain logits). FSDP2
    gathers its weight around this call whichever way it runs."""

    chunk = 0
    vocab_mesh = None  # set by parallel/tensor_parallel.py: the weight's rows split over this mesh

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.vocab_mesh is not None:  # vocabulary-parallel (models/vocab_parallel.py)
            return self._vocab_parallel(hidden, labels)
        if labels is None:
            return super().forward(hidden)
        if self.chunk <= 0:
            logits = super().forward(hidden)
            flat = logits.float().reshape(-1, logits.shape[-1])
            return F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
        return linear_cross_entropy_sum(hidden, self.weight, labels, self.chunk)

    def _vocab_parallel(self, hidden: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        mesh = self.vocab_mesh
        if labels is None:
            return vocab_parallel_logits(hidden, self.weight, mesh)
        local = local_rows(self.weight)
        start = mesh.get_local_rank() * local.shape[0]
        return vocab_parallel_loss_sum(hidden, local, labels, self.chunk, mesh.get_group(), start)
