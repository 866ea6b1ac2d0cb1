"""Microbatches for one data-parallel rank, with exact resume.

Decoding runs in ``data.num_workers`` DataLoader worker processes. Worker w
of W decodes the stream elements whose index is congruent to w modulo W (webdataset's
``split_by_worker``), and
emits exactly one item per element (a decoded sample or a skip record), so the
DataLoader's round-robin collection returns the stream in its original order:
results do not depend on the number of workers.

The loader's state is the stream position after the last element the trainer
*consumed* (not what workers prefetched), plus skip counters. It is saved per
data-parallel rank with every checkpoint; a resumed run starts its stream at
that position and sees exactly the samples an uninterrupted run would.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset
from webdataset.shardlists import split_by_worker

from ..base.processes import helper_process_init
from .bad_sample import UnusableRow
from .batch import Batch
from .reader import Position, RawSample, ShardError, ShardStream, StreamElement
from .samples import BadSample, EncodedSample, SampleEncoder

log = logging.getLogger(__name__)

# Give up when this many consecutive elements are unusable: the data is broken, not noisy.
MAX_CONSECUTIVE_SKIPS = 10_000


@dataclass
class Skipped:
    key: str
    reason: str
    detail: str


@dataclass
class LoadedItem:
    position: Position
    sample: EncodedSample | Skipped


class DecodedStream(IterableDataset):
    def __init__(self, stream: ShardStream, encoder: SampleEncoder, start: Position):
        super().__init__()
        self.stream = stream
        self.encoder = encoder
        self.start = start

    def __iter__(self) -> Iterator[LoadedItem]:
        elements = split_by_worker(self.stream.elements(self.start))  # worker w of W: elements w, w + W, ...
        for element in elements:
            yield LoadedItem(element.position, self._decode(element))

    def _decode(self, element: StreamElement) -> EncodedSample | Skipped:
        item = element.item
        if isinstance(item, ShardError):
            return Skipped(item.shard, "shard_error", item.reason)
        if isinstance(item, UnusableRow):  # data.format=hf: a row the column mapping cannot read
            return Skipped(item.key, item.reason, item.detail)
        assert isinstance(item, RawSample)
        try:
            return self.encoder.encode(item.key, item.members)
        except BadSample as error:
            return Skipped(item.key, error.reason, str(error))


# Decode workers are children of their rank, forked where the platform can: instant, and their parent
# is the rank (the parent-death check relies on it). The inherited default would not do: in a rank
# started by a fork server (trainer.start_method) it is the fork server's, which makes workers the
# children of a second server and starts each from a fresh interpreter.
DECODE_START_METHOD = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def _init_decode_worker(parent: int, nice: int, worker_id: int) -> None:
    """Decode workers die with their rank, leave Ctrl-C and SIGTERM to it, and yield the CPU to the
    training threads (see data.worker_nice)."""
    helper_process_init(parent, nice)


def collate(samples: list[EncodedSample]) -> Batch:
    def stack(name: str) -> torch.Tensor:
        return torch.from_numpy(np.stack([getattr(s, name) for s in samples]))

    def joined(name: str) -> dict[str, torch.Tensor]:  # a per-item field (images, clips, groups) and per-row counts
        parts = [getattr(s, name) for s in samples]
        counts = torch.tensor([part.shape[0] for part in parts], dtype=torch.int64)
        return {name: torch.from_numpy(np.concatenate(parts)), f"{name.rstrip('s')}_counts": counts}

    def row(name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([getattr(s, name) for s in samples], dtype=dtype)

    return Batch(
        tokens=stack("tokens"),
        labels=stack("labels"),
        **joined("images"),
        gen_images=stack("gen_image"),
        gen_weight=row("gen_weight", torch.float32),
        gen_noise=stack("gen_noise"),
        gen_timesteps=row("gen_timestep", torch.int64),
        keys=[s.key for s in samples],
        **joined("audio"),
        gen_audio=stack("gen_audio"),
        audio_gen_weight=row("audio_gen_weight", torch.float32),
        audio_gen_noise=stack("audio_gen_noise"),
        audio_gen_timesteps=row("audio_gen_timestep", torch.int64),
        **joined("video"),
    )


class MicrobatchLoader:
    """Yields, per optimizer step, this rank's microbatches of the global batch."""

    def __init__(
        self,
        stream: ShardStream,
        encoder: SampleEncoder,
        micro_batch_size: int,
        microbatches_per_step: int,
        num_workers: int = 0,
        prefetch_steps: int = 2,
        worker_nice: int = 0,
        state: dict | None = None,
    ):
        self.stream = stream
        self.encoder = encoder
        self.micro_batch_size = micro_batch_size
        self.microbatches_per_step = microbatches_per_step
        self.num_workers = num_workers
        self.prefetch_steps = prefetch_steps
        self.worker_nice = worker_nice
        state = state or {}
        self.position = Position(int(state.get("epoch", 0)), int(state.get("index", 0)))
        self.skipped: Counter[str] = Counter(state.get("skipped", {}))
        self.truncated_images = int(state.get("truncated_images", 0))
        self.truncated_audio = int(state.get("truncated_audio", 0))
        self._items: Iterator[LoadedItem] | None = None

    def _iterator(self) -> Iterator[LoadedItem]:
        dataset = DecodedStream(self.stream, self.encoder, self.position)
        if self.num_workers == 0:
            return iter(dataset)
        # DataLoader prefetches per worker and per item (= sample here): size it in steps.
        samples_per_step = self.micro_batch_size * self.microbatches_per_step
        per_worker = -(-self.prefetch_steps * samples_per_step // self.num_workers)
        loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=max(2, per_worker),
            persistent_workers=False,
            multiprocessing_context=DECODE_START_METHOD,
            worker_init_fn=functools.partial(_init_decode_worker, os.getpid(), self.worker_nice),
        )
        return iter(loader)

    def next_sample(self) -> EncodedSample:
        if self._items is None:
            self._items = self._iterator()
        consecutive = 0
        while True:
            item = next(self._items)
            self.position = Position(item.position.epoch, item.position.index + 1)
            sample = item.sample
            if isinstance(sample, Skipped):
                self.skipped[sample.reason] += 1
                consecutive += 1
                log.warning("skipped sample %s (%s): %s", sample.key, sample.reason, sample.detail)
                if consecutive >= MAX_CONSECUTIVE_SKIPS:
                    raise RuntimeError(f"{consecutive} unusable samples in a row; last: {sample.detail}")
                continue
            self.truncated_images += sample.truncated_images
            self.truncated_audio += sample.truncated_audio
            return sample

    def next_step(self) -> list[Batch]:
        """The microbatches of this rank for the next optimizer step."""
        return [
            collate([self.next_sample() for _ in range(self.micro_batch_size)])
            for _ in range(self.microbatches_per_step)
        ]

    def state_dict(self) -> dict:
        return {
            "epoch": self.position.epoch,
            "index": self.position.index,
            "skipped": dict(self.skipped),
            "truncated_images": self.truncated_images,
            "truncated_audio": self.truncated_audio,
        }
