"""Pre-tokenized text from one token file (``data.format=tokens``): the layout of nanoGPT's ``train.bin``,
Megatron-LM's GPT dataset and LitGPT's pretraining data, without their index files.

The file is a NumPy ``.npy`` array: one dimension, an integer dtype (uint16 fits vocabularies up to 65,536),
documents concatenated with whatever separator token the tokenizer uses (``np.save(path, ids)`` writes one).
It is memory-mapped: only the windows a step reads are paged in, and every training process of a machine
shares the page cache.

A training sample is a window of ``seq_len + 1`` consecutive tokens (inputs and next-token labels) starting at
a multiple of ``seq_len``; attention is causal over the whole window, across document boundaries, as in
those three projects (packed documents with masks are ``data.packing``). Every epoch visits every window once,
in an order drawn from (seed, epoch). The global batch of step ``k`` is windows ``k*G .. k*G+G-1`` of that
order, so it depends on (seed, step) only: every layout reads the same global batch and takes its share, and a
resumed run reads exactly what it would have read. A window holding a token outside the model's vocabulary
is skipped and counted (``data/skipped_samples``), and the next window takes its place.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch

from .batch import Batch, text_rows

SKIP_REASON = "token_outside_vocabulary"


def open_tokens(path: str | Path) -> np.ndarray:
    """The memory-mapped token array; ValueError naming the problem if the file is not a 1-D integer .npy."""
    path = Path(path)
    if path.suffix != ".npy":
        raise ValueError(f"data.path={str(path)!r}: data.format=tokens reads a NumPy .npy file of token ids")
    if not path.is_file():
        raise ValueError(
            f"data.path={str(path)!r}: no such file; write one with np.save(path, np.asarray(ids, dtype=np.uint16)) "
            "(docs/DATA.md)"
        )
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as error:
        raise ValueError(f"data.path={str(path)!r} is not a readable .npy array: {error}") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"data.path={str(path)!r} holds a {tokens.ndim}-D {tokens.dtype} array; data.format=tokens needs a "
            "1-D integer array of token ids (np.save(path, np.asarray(ids, dtype=np.uint16)))"
        )
    return tokens


def window_count(tokens: np.ndarray, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens starting at multiples of ``seq_len``."""
    return max(0, (len(tokens) - 1) // seq_len)


class TokenFileLoader:
    """``next_step()``: ``microbatches`` Batches of ``rows`` windows each (the global batch of one step, in
    microbatch slots; the trainer keeps its replica's block of every slot)."""

    def __init__(self, path: str | Path, seq_len: int, rows: int, microbatches: int, vocab: int, seed: int, state=None):
        self.tokens = open_tokens(path)
        self.seq_len, self.rows, self.microbatches = seq_len, rows, microbatches
        self.vocab, self.seed = vocab, seed
        self.windows = window_count(self.tokens, seq_len)
        if self.windows < 1:
            raise ValueError(
                f"data.path={str(path)!r} has {len(self.tokens)} tokens: fewer than one window of "
                f"model.seq_len + 1 = {seq_len + 1}"
            )
        state = state or {}
        self.step = int(state.get("step", 0))
        self.cursor = int(state.get("cursor", self.step * rows * microbatches))  # windows consumed, skips included
        self.skipped: Counter[str] = Counter(state.get("skipped", {}))
        self.truncated_images = 0  # the metrics of image data read it
        self._order: tuple[int, torch.Tensor] | None = None

    def _window(self, index: int) -> int:
        """The start of the ``index``-th window of the stream (epochs in a row, each in its own order)."""
        epoch, position = divmod(index, self.windows)
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(self.windows, generator=generator))
        return int(self._order[1][position]) * self.seq_len

    def _next_row(self) -> np.ndarray:
        for _ in range(self.windows):  # a whole epoch's worth of windows in a row, none usable: a wrong file
            start = self._window(self.cursor)
            self.cursor += 1
            row = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
            if int(row.max()) < self.vocab and int(row.min()) >= 0:
                return row
            self.skipped[SKIP_REASON] += 1
        raise ValueError(
            f"{self.windows} windows in a row hold ids outside model.llm.vocab_size={self.vocab}: the token file was "
            "written by another tokenizer"
        )

    def next_step(self) -> list[Batch]:
        out = []
        for _ in range(self.microbatches):
            block = torch.from_numpy(np.stack([self._next_row() for _ in range(self.rows)]))
            out.append(text_rows(block[:, :-1].contiguous(), block[:, 1:].contiguous(), key="w"))
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "cursor": self.cursor, "skipped": dict(self.skipped)}


def token_loader(cfg, rows: int, microbatches: int, state: dict | None) -> TokenFileLoader:
    """The loader ``data.format=tokens`` describes: ``microbatches`` slots of ``rows`` windows per step."""
    m = cfg.model
    return TokenFileLoader(cfg.data.path, m.seq_len, rows, microbatches, m.llm.vocab_size, cfg.trainer.seed, state)
