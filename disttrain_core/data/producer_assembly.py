"""A producer's global batches: every sample of a step planned, its share of them decoded.

A producer pool (``data.producer.count``) splits each step's samples between its producers by data-parallel
group: producer p of P serves the groups ``[p*G/P, (p+1)*G/P)`` of the canonical grid of G groups
(data/reorder.py), the same share of every microbatch slot. For the batches not to depend on P, every producer
reads the one canonical stream and *plans* every sample (``SampleEncoder.plan``: parsed, tokenized, its images'
headers read, nothing decoded) -- which samples a step takes, their order after reordering, and the step's
loss normalizers follow from the plans alone. Only the samples of its own share are decoded
(``SampleEncoder.finish``, the expensive part), in ``data.producer.workers`` processes.

A sample whose image headers read but whose pixels do not decode (a truncated body) cannot be skipped any more:
the other producers planned the step around it. It keeps its place with its images zeroed and no loss (labels
-100, generation weight 0), counted in the producer's log; the step's normalizers still count it as planned.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..base.processes import helper_process_init
from .blend import open_stream
from .loader import DECODE_START_METHOD, MicrobatchLoader, collate
from .producer_protocol import Layout, StepSummary
from .reorder import arrange
from .samples import BadSample, EncodedSample, PlannedSample, SampleEncoder

log = logging.getLogger("disttrain_core.data.producer")


def sample_costs(costs: tuple, samples) -> list[float]:
    """Training work per sample in FLOPs from the trainers' per-item ``costs`` (Layout.costs): its images
    through the encoder, the LLM row, the generation target, its audio clips through the audio tower and its
    video frame groups through the video tower."""
    per_image, per_row, per_target, per_clip, per_group = costs
    return [
        per_row
        + per_image * len(s.images)
        + per_target * float(s.gen_weight)
        + per_clip * len(s.audio)
        + per_group * len(s.video)
        for s in samples
    ]


def share_of(layout: Layout, index: int, count: int) -> range:
    """The samples of every slot producer ``index`` of ``count`` serves: whole groups of the canonical grid."""
    if not 0 <= index < count <= layout.groups:
        raise ValueError(
            f"producer {index} of {count}: a pool has at most one producer per data-parallel group "
            f"({layout.groups} here)"
        )
    width = layout.samples_per_slot // layout.groups
    return range(index * layout.groups // count * width, (index + 1) * layout.groups // count * width)


class _Planning:
    """The loader's encoder for a producer: plans samples instead of decoding them."""

    def __init__(self, encoder: SampleEncoder):
        self.plan = encoder.plan

    def encode(self, key: str, members: dict[str, bytes]) -> PlannedSample:
        return self.plan(key, members)


_ENCODER: SampleEncoder | None = None  # a decode worker's


def _init_decoder(parent: int, encoder: SampleEncoder) -> None:
    global _ENCODER
    helper_process_init(parent)
    _ENCODER = encoder


def _finish_with(encoder: SampleEncoder, planned: PlannedSample) -> EncodedSample | str:
    """The decoded sample, or why its pixels did not decode."""
    try:
        return encoder.finish(planned)
    except BadSample as error:
        return str(error)


def _finish(planned: PlannedSample) -> EncodedSample | str:
    """``_finish_with`` in a decode worker (its encoder came with ``_init_decoder``)."""
    assert _ENCODER is not None
    return _finish_with(_ENCODER, planned)


def blank(encoder: SampleEncoder, planned: PlannedSample) -> EncodedSample:
    """A planned sample whose pixels (or clips) did not decode: its place and shapes, zero images and clips, no
    loss."""
    empty = PlannedSample(planned.key, planned.tokens, np.full_like(planned.labels, -100), [], 0.0)
    sample = encoder.finish(empty)
    size = encoder.image_size
    sample.images = np.zeros((len(planned.images), 3, size, size), dtype=np.uint8)
    sample.truncated_images = planned.truncated_images
    if planned.audio:
        sample.audio = np.zeros((len(planned.audio), *sample.audio.shape[1:]), dtype=np.float32)
    if planned.video:
        sample.video = np.zeros((len(planned.video), *sample.video.shape[1:]), dtype=np.uint8)
    sample.truncated_audio = planned.truncated_audio
    return sample


@dataclass
class Assembled:
    step: int
    batch: object  # Batch: the share's samples of every slot, slot after slot
    state: dict  # the stream position after this step, and the skip counters
    summary: StepSummary  # of the whole global batch (from the plans)


class BatchAssembler:
    """Global batches in stream order, reordered; the share ``[index, count]`` of every slot decoded."""

    def __init__(self, cfg, layout: Layout, start: dict, share: tuple[int, int] = (0, 1)):
        self.cfg, self.layout = cfg, layout
        self.own = share_of(layout, *share)
        data, trainer = cfg.data, cfg.trainer
        try:
            stream = open_stream(data, trainer.seed)
        except ValueError as error:  # ShardStream: no shards to read
            where = "data.blend's sources" if data.blend else f"data.path={data.path!r}"
            raise FileNotFoundError(f"no .tar shards at {where} on the producer's host ({error})") from None
        from .tokenizer import tokenizer_for

        self.encoder = SampleEncoder(
            cfg.model, tokenizer_for(cfg), trainer.seed, data.max_image_pixels, data.video_frames, data.chat_template
        )
        self.batch_size = layout.slots * layout.samples_per_slot
        workers = int(data.producer.workers)
        self.loader = MicrobatchLoader(
            stream,
            _Planning(self.encoder),  # type: ignore[arg-type]
            self.batch_size,
            1,
            num_workers=workers,
            prefetch_steps=int(data.producer.prefetch_steps),
            state=start,
        )
        self.pool = None
        if workers > 0:
            self.pool = ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context(DECODE_START_METHOD),
                initializer=_init_decoder,
                initargs=(os.getpid(), self.encoder),
            )
        self.step = int(start.get("step", 0))

    def next(self) -> Assembled:
        planned = [self.loader.next_sample() for _ in range(self.batch_size)]
        reorder = self.cfg.data.producer.reorder
        layout = self.layout
        order = arrange(
            sample_costs(layout.costs, planned),
            layout.slots,
            layout.samples_per_slot,
            layout.groups,
            layout.stages,
            intra=bool(reorder.intra),
            inter=bool(reorder.inter),
        )
        arranged = [planned[i] for i in order]
        per = layout.samples_per_slot
        own = [arranged[k * per + j] for k in range(layout.slots) for j in self.own]
        batch = collate(self._decode(own))
        self.step += 1
        state = {**self.loader.state_dict(), "step": self.step}
        return Assembled(self.step, batch, state, planned_summary(arranged, layout.slots))

    def _decode(self, planned: list[PlannedSample]) -> list[EncodedSample]:
        if self.pool is None:
            results = [_finish_with(self.encoder, p) for p in planned]
        else:
            chunk = max(1, len(planned) // (4 * int(self.cfg.data.producer.workers)))
            results = list(self.pool.map(_finish, planned, chunksize=chunk))
        decoded = []
        for plan, result in zip(planned, results, strict=True):
            if isinstance(result, str):
                log.warning("sample %s kept with no loss: its pixels do not decode (%s)", plan.key, result)
                result = blank(self.encoder, plan)
            decoded.append(result)
        return decoded

    def close(self) -> None:
        self.loader._items = None  # drops the DataLoader iterator: its planning workers exit
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def planned_summary(samples: list[PlannedSample], slots: int) -> StepSummary:
    """The StepSummary of a global batch from its plans: what decoding it whole would count."""
    per = len(samples) // slots
    counts = torch.tensor([len(s.images) for s in samples], dtype=torch.int64).view(slots, per)
    tokens = torch.tensor([int((s.labels != -100).sum()) for s in samples], dtype=torch.int64).view(slots, per)
    weights = torch.tensor([s.gen_weight + s.audio_gen_weight for s in samples], dtype=torch.float32).view(slots, per)
    clips = torch.tensor([len(s.audio) for s in samples], dtype=torch.int64).view(slots, per)
    groups = torch.tensor([len(s.video) for s in samples], dtype=torch.int64).view(slots, per)
    return StepSummary(
        counts, tokens.sum(dim=1), weights.sum(dim=1), counts.sum(dim=1), clips.sum(dim=1), clips, groups
    )
