"""Steps of packed variable-length text (``data.packing.enabled``): every process builds the whole step --
``documents_per_step`` documents, bucketed and packed (data/packing.py) -- and the engine takes its share.

Sources: ``corpus`` reads the documents of a text corpus on disk (data/corpus.py: JSON lines or webdataset
shards, such as the embedded LAION-like shards' captions). ``commoncrawl`` and ``github`` draw synthetic
documents whose lengths follow those long-tail profiles; ``dense`` draws documents_per_step / buckets
documents of exactly each bucket's length, so every row is one document (tools/profile_hotspa.py). Each
is a short random motif repeated with a little noise, so a model can learn it (attention has to find the
motif's period inside its own document).
A step's documents depend only on (seed, step) -- for a corpus, on the step and the corpus's order: the
data position is the step number, and a resumed run sees exactly the documents it would have seen.
"""

from __future__ import annotations

from collections import Counter

import torch

from .batch import Batch, pad_rows, text_rows
from .packing import bucket_and_pack, bucket_boundaries, pack_rows, sample_lengths

SOURCES = ("commoncrawl", "github", "corpus", "dense")


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
    return text_rows(rows.tokens, rows.labels, rows.doc_ids, rows.positions)


class PackedStepLoader:
    """``next_step()``: one Batch per bucket holding all of the step's packed rows of that bucket."""

    def __init__(
        self,
        source: str,
        documents: int,
        boundaries: list[int],
        vocab: int,
        seed: int,
        state=None,
        length_scale: float = 1.0,
        corpus=None,
    ):
        """``corpus``: a data/corpus.py CorpusDocuments, for ``source="corpus"``."""
        if source not in SOURCES:
            raise ValueError(f"data.packing.source={source!r}: allowed values are {', '.join(SOURCES)}")
        self.source, self.documents, self.boundaries = source, documents, list(boundaries)
        self.length_scale = float(length_scale)
        self.vocab, self.seed = vocab, seed
        self.step = int((state or {}).get("step", 0))
        self.skipped: Counter[str] = Counter((state or {}).get("skipped", {}))
        self.truncated_images = 0
        self.last_lengths: list[int] = []
        self.corpus = corpus
        if (source == "corpus") != (corpus is not None):
            raise ValueError("data.packing.source=corpus reads data.packing.corpus; the other sources read none")
        if corpus is not None:
            corpus.skipped = self.skipped  # one set of counts, saved with the step

    def step_documents(self, step: int) -> list[torch.Tensor]:
        if self.corpus is not None:
            return self.corpus.documents(step, self.documents)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        if self.source == "dense":
            each = max(1, self.documents // len(self.boundaries))
            return [synthetic_document(b, self.vocab, generator) for b in self.boundaries for _ in range(each)]
        lengths = sample_lengths(self.source, self.documents, self.boundaries[-1], generator, scale=self.length_scale)
        return [synthetic_document(n, self.vocab, generator) for n in lengths]

    def next_step(self) -> list[Batch]:
        docs = self.step_documents(self.step)
        self.step += 1
        lengths = [d.numel() for d in docs]
        self.last_lengths = lengths
        masks = self.corpus.masks if self.corpus is not None else None  # conversations: loss on the assistant
        buckets = bucket_and_pack(lengths, self.boundaries)
        return [text_batch(pack_rows(docs, b.rows, b.capacity, masks=masks)) for b in buckets]

    def state_dict(self) -> dict:
        return {"step": self.step, "skipped": dict(self.skipped)}


def replica_rows(buckets: list[Batch], rows_per_microbatch: list[int], replicas: int, replica: int) -> list[Batch]:
    """Data parallelism over packed buckets: bucket k's rows cut into slots of ``rows_per_microbatch[k]`` rows
    per replica (the last slot padded with empty rows); ``replica``'s block of every slot, in order. Every
    replica gets the same number of microbatches."""
    out = []
    for rows, per_replica in zip(buckets, rows_per_microbatch, strict=True):
        block = range(replica * per_replica, (replica + 1) * per_replica)
        out += [mb.select(block) for mb in pad_rows(rows, per_replica * replicas)]
    return out


HELD_OUT_SEED = 7919  # added to the seed of the held-out documents of the synthetic sources


def corpus_path(data) -> str | None:
    """The packed corpus: data.packing.corpus, or with data=hf (unset) data.path's files."""
    if data.packing.corpus is None and data.format == "hf":
        return str(data.path)
    return None if data.packing.corpus is None else str(data.packing.corpus)


def packed_loader(cfg, state: dict | None, held_out: bool = False) -> PackedStepLoader:
    """The loader ``data.packing`` describes (resumed at ``state``'s step). ``held_out``: the validation split's,
    from its first step -- the documents of ``data.val.path`` for a corpus, else the synthetic source's documents
    of another seed (never a training step's: those are drawn from (seed, step))."""
    packing = cfg.data.packing
    boundaries = bucket_boundaries(cfg)
    vocab = cfg.model.llm.vocab_size
    seed = int(cfg.trainer.seed) + (HELD_OUT_SEED if held_out else 0)
    corpus = None
    if packing.source == "corpus":
        from .conversations import template_source
        from .corpus import CorpusDocuments
        from .tokenizer import tokenizer_for

        path = cfg.data.val.path if held_out else corpus_path(cfg.data)
        columns = dict(cfg.data.hf.columns) if cfg.data.format == "hf" else None
        template = template_source(str(cfg.data.chat_template), str(cfg.data.tokenizer))
        corpus = CorpusDocuments(path, tokenizer_for(cfg), boundaries[-1], seed, template, columns)
    return PackedStepLoader(
        packing.source,
        packing.documents_per_step,
        boundaries,
        vocab,
        seed,
        state,
        length_scale=packing.length_scale,
        corpus=corpus,
    )


def describe(cfg) -> str:
    packing = cfg.data.packing
    if packing.source == "corpus":
        return (
            f"{packing.documents_per_step} documents per step of {corpus_path(cfg.data)} in buckets "
            f"{bucket_boundaries(cfg)}"
        )
    scaled = f" (lengths x {packing.length_scale:g})" if packing.length_scale != 1.0 else ""
    return (
        f"{packing.documents_per_step} {packing.source} documents per step{scaled} in buckets {bucket_boundaries(cfg)}"
    )
