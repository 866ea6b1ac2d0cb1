"""Steps of packed variable-length text (``data.packing.enabled``): every process builds the whole step --
``documents_per_step`` documents, bucketed and packed (data/packing.py) -- and the engine takes its share.

Sources: ``commoncrawl`` and ``github`` draw synthetic documents whose lengths follow those long-tail
profiles. Each document is a short random motif repeated with a little noise, so a model can learn it
(attention has to find the motif's period inside its own document). A step's documents depend only on
(seed, step): the data position is the step number, and a resumed run sees exactly the documents it
would have seen.
"""

from __future__ import annotations

from collections import Counter

import torch

from .batch import Batch, pad_rows
from .packing import bucket_and_pack, bucket_boundaries, pack_rows, sample_lengths

SOURCES = ("commoncrawl", "github")


def synthetic_document(length: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """A motif of 3-8 tokens repeated to ``length``, 5% of the tokens replaced by random ones."""
    period = int(torch.randint(3, 9, (1,), generator=generator))
    motif = torch.randint(1, vocab, (period,), generator=generator)
    doc = motif.repeat(-(-length // period))[:length].clone()
    noise = torch.rand(length, generator=generator) < 0.05
    doc[noise] = torch.randint(1, vocab, (int(noise.sum()),), generator=generator)
    return doc


def text_batch(rows) -> Batch:
    """A Batch of packed rows for a text-only model (no images, no generation targets)."""
    b = rows.tokens.shape[0]
    return Batch(
        tokens=rows.tokens,
        labels=rows.labels,
        images=torch.zeros((0, 3, 1, 1), dtype=torch.uint8),
        image_counts=torch.zeros(b, dtype=torch.int64),
        gen_images=torch.zeros((b, 3, 1, 1), dtype=torch.uint8),
        gen_weight=torch.zeros(b, dtype=torch.float32),
        gen_noise=torch.zeros((b, 1, 1, 1), dtype=torch.float32),
        gen_timesteps=torch.zeros(b, dtype=torch.int64),
        doc_ids=rows.doc_ids,
        positions=rows.positions,
        keys=[f"row{i}" for i in range(b)],
    )


class PackedStepLoader:
    """``next_step()``: one Batch per bucket holding all of the step's packed rows of that bucket."""

    def __init__(self, source: str, documents: int, boundaries: list[int], vocab: int, seed: int, state=None):
        if source not in SOURCES:
            raise ValueError(f"data.packing.source={source!r}: allowed values are {', '.join(SOURCES)}")
        self.source, self.documents, self.boundaries = source, documents, list(boundaries)
        self.vocab, self.seed = vocab, seed
        self.step = int((state or {}).get("step", 0))
        self.skipped: Counter[str] = Counter()
        self.truncated_images = 0
        self.last_lengths: list[int] = []

    def step_documents(self, step: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        lengths = sample_lengths(self.source, self.documents, self.boundaries[-1], generator)
        return [synthetic_document(n, self.vocab, generator) for n in lengths]

    def next_step(self) -> list[Batch]:
        docs = self.step_documents(self.step)
        self.step += 1
        lengths = [d.numel() for d in docs]
        self.last_lengths = lengths
        return [text_batch(pack_rows(docs, b.rows, b.capacity)) for b in bucket_and_pack(lengths, self.boundaries)]

    def state_dict(self) -> dict:
        return {"step": self.step}


def replica_rows(buckets: list[Batch], rows_per_microbatch: int, replicas: int, replica: int) -> list[Batch]:
    """Data parallelism over packed buckets: each bucket's rows cut into slots of ``rows_per_microbatch``
    rows per replica (the last slot padded with empty rows); ``replica``'s block of every slot, in order.
    Every replica gets the same number of microbatches."""
    out = []
    slot = rows_per_microbatch * replicas
    block = range(replica * rows_per_microbatch, (replica + 1) * rows_per_microbatch)
    for rows in buckets:
        out += [mb.select(block) for mb in pad_rows(rows, slot)]
    return out


def packed_loader(cfg, state: dict | None) -> PackedStepLoader:
    """The loader ``data.packing`` describes (resumed at ``state``'s step)."""
    packing = cfg.data.packing
    boundaries = bucket_boundaries(cfg)
    vocab = cfg.model.llm.vocab_size
    return PackedStepLoader(packing.source, packing.documents_per_step, boundaries, vocab, cfg.trainer.seed, state)


def describe(cfg) -> str:
    packing = cfg.data.packing
    return f"{packing.documents_per_step} {packing.source} documents per step in buckets {bucket_boundaries(cfg)}"
