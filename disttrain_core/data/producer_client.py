"""The trainer's side of the data producer: global batches, split into microbatch slots.

A dropped connection is not the end of a run: the loader reconnects (backoff up to 2 s,
for at most ``data.producer.timeout_s``) and says HELLO again with its current data position,
so a producer restarted on the same address continues the same stream. What the producer
refuses or cannot do arrives as its text and ends the run with a ``RuntimeError``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ..base.net import split_address
from .batch import Batch, concat
from .producer_protocol import Layout, StepSummary, Want, decode_batch, decode_share, job_identity
from .reorder import canonical_groups
from .transport import (
    BATCH,
    BYE,
    ERROR,
    HELLO,
    REQUEST,
    WELCOME,
    AuthenticationError,
    Channel,
    ProtocolError,
    client_channel,
    load_key,
)

log = logging.getLogger(__name__)


class Refused(Exception):
    """The producer answered with an ERROR frame: its text."""


class ProducerLoader:
    """The trainer's side: global batches from a producer, split into microbatch slots.

    With ``block`` (a range of a slot's samples: this trainer's unit replica's) the producer sends only those
    samples of every slot, of them only ``fields`` (None: all; the others arrive as zeros of their shapes), and
    a ``StepSummary`` of the whole batch (``summary``); ``next_step`` then returns the block of each slot.
    Without, every slot whole."""

    def __init__(
        self,
        address: str,
        key: bytes,
        layout: Layout,
        start: dict | None,
        timeout_s: float,
        limit: int,
        block: range | None = None,
        fields: tuple[str, ...] | None = None,
        pool: tuple[int, int] = (0, 1),
    ):
        self.address, self.key, self.timeout, self.limit = address, key, float(timeout_s), int(limit)
        self.layout, self.pool = layout, pool
        self.want = None if block is None else Want.of(block, fields)
        self.summary: StepSummary | None = None  # of the last step, with a block
        self.bytes_received = 0  # frames of the last step, framing included
        self.trainer = os.urandom(8).hex()  # this trainer across reconnects
        self.state = dict(start or {})
        self.step = int(self.state.get("step", 0))
        self.skipped: dict[str, int] = dict(self.state.get("skipped", {}))
        self.truncated_images = int(self.state.get("truncated_images", 0))
        self.reconnects = 0
        self.channel: Channel | None = None
        self._connect_until_deadline("cannot reach the data producer at {address}")

    # ------------------------------------------------------------------ connection
    def _hello(self) -> Channel:
        """One attempt: connect, greet, HELLO with the current position, WELCOME."""
        sock = socket.create_connection(split_address(self.address), timeout=self.timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + self.timeout
            channel = client_channel(sock, self.key, self.limit, timeout=self.timeout, deadline=deadline)
            start = {**self.state, "step": self.step}
            hello = {"layout": self.layout.to_dict(), "job": dict(self.layout.job), "start": start}
            if self.want is not None:
                hello.update(self.want.to_hello())
            if self.pool != (0, 1):
                hello["pool"] = list(self.pool)
            channel.send(HELLO, {**hello, "trainer": self.trainer})
            kind, meta, _ = channel.recv()
            if kind == ERROR:
                raise Refused(str(meta.get("error")))
            if kind != WELCOME:
                raise ProtocolError(f"expected WELCOME, got frame kind {kind}")
            channel.deadline = None
            return channel
        except BaseException:
            sock.close()
            raise

    def _connect_until_deadline(self, failure: str) -> None:
        deadline = time.monotonic() + self.timeout
        delay, last = 0.1, None
        while True:
            try:
                self.channel = self._hello()
                return
            except Refused as error:
                raise RuntimeError(f"the data producer at {self.address} refused this trainer: {error}") from None
            except AuthenticationError as error:
                raise RuntimeError(
                    f"the data producer at {self.address} and this trainer do not share a key "
                    f"(data.producer.key / DISTTRAIN_PRODUCER_KEY): {error}"
                ) from None
            except ProtocolError as error:
                raise RuntimeError(f"the data producer at {self.address} broke the protocol: {error}") from None
            except (OSError, ValueError) as error:  # refused, reset, closed, timed out; ValueError: bad port
                last = error
            if time.monotonic() + delay > deadline:
                raise RuntimeError(
                    failure.format(address=self.address)
                    + f": no producer answered there for {self.timeout:.0f} s (data.producer.timeout_s); "
                    f"last error: {last}"
                ) from last
            time.sleep(delay)
            delay = min(2.0 * delay, 2.0)

    def _drop(self) -> None:
        if self.channel is not None:
            self.channel.sock.close()
            self.channel = None

    # ------------------------------------------------------------------ batches
    def next_step(self) -> list[Batch]:
        while True:
            if self.channel is None:
                self._connect_until_deadline(f"lost the data producer at {{address}} before step {self.step + 1}")
                self.reconnects += 1
                log.warning("reconnected to the data producer at %s after step %d", self.address, self.step)
            try:
                self.channel.send(REQUEST, {"step": self.step + 1})
                before = self.channel.bytes_received
                kind, meta, payload = self.channel.recv()
                self.bytes_received = self.channel.bytes_received - before
                break
            except TimeoutError as error:
                self._drop()
                raise RuntimeError(
                    f"the data producer at {self.address} sent nothing for {self.timeout:.0f} s "
                    "(data.producer.timeout_s): is it alive?"
                ) from error
            except ProtocolError as error:
                self._drop()
                raise RuntimeError(f"the data producer at {self.address} sent an invalid frame: {error}") from error
            except OSError as error:  # the connection dropped: reconnect and ask again
                log.warning("lost the connection to the data producer at %s: %s", self.address, error)
                self._drop()
        if kind == ERROR:
            self._drop()
            raise RuntimeError(f"the data producer at {self.address} failed: {meta.get('error')}")
        state = meta.get("state")
        if kind != BATCH or meta.get("step") != self.step + 1 or not isinstance(state, dict):
            self._drop()
            raise RuntimeError(f"the data producer sent frame {kind} for step {meta.get('step')}")
        per = self.layout.samples_per_slot
        try:
            if self.want is not None:
                slots, self.summary = decode_share(meta, payload, self.layout.slots, per, self.want, self.limit)
            else:
                batch = decode_batch(meta, payload)
                slots = [batch.select(range(k * per, (k + 1) * per)) for k in range(self.layout.slots)]
        except ProtocolError as error:
            self._drop()
            raise RuntimeError(f"the data producer sent an invalid batch: {error}") from error
        self.step += 1
        self.state = dict(state)
        self.skipped = dict(self.state.get("skipped", {}))
        self.truncated_images = int(self.state.get("truncated_images", 0))
        return slots

    def state_dict(self) -> dict:
        return dict(self.state)

    def close(self) -> None:
        if self.channel is not None:
            try:
                self.channel.send(BYE, {})
            except OSError:
                pass
            self._drop()


class ProducerPool:
    """The trainer's side of a pool of producers (data.producer.count, or several addresses): producer p of P
    serves samples ``share_of(layout, p, P)`` of every slot, so this trainer fetches its block of every slot
    from the producers whose shares it meets (``connections``: [(producer, its part of the block, trainers that
    fetch from it)]) and joins the parts. Every producer sends the same stream state and step summary."""

    def __init__(
        self,
        addresses: list[str],
        key: bytes,
        layout: Layout,
        start: dict | None,
        timeout_s: float,
        limit: int,
        connections: list[tuple[int, range, int]],
        fields: tuple[str, ...] | None = None,
    ):
        count = len(addresses)
        self.parts = [
            ProducerLoader(
                addresses[p], key, replace(layout, world=world), start, timeout_s, limit, part, fields, (p, count)
            )
            for p, part, world in connections
        ]
        self.layout = layout
        first = self.parts[0]
        self.state, self.step = first.state, first.step
        self.skipped, self.truncated_images = first.skipped, first.truncated_images
        self.summary: StepSummary | None = None
        self.bytes_received = 0

    @property
    def reconnects(self) -> int:
        return sum(part.reconnects for part in self.parts)

    def next_step(self) -> list[Batch]:
        shares = [part.next_step() for part in self.parts]
        first = self.parts[0]
        for part in self.parts[1:]:
            if part.state != first.state or not _same_summary(part.summary, first.summary):
                raise RuntimeError(
                    f"the data producers at {first.address} and {part.address} disagree on step {first.step} "
                    f"(stream state {first.state} against {part.state}): do they read the same data?"
                )
        self.step, self.state, self.summary = first.step, first.state, first.summary
        self.skipped, self.truncated_images = first.skipped, first.truncated_images
        self.bytes_received = sum(part.bytes_received for part in self.parts)
        return [concat(list(slot)) for slot in zip(*shares, strict=True)]

    def state_dict(self) -> dict:
        return dict(self.state)

    def close(self) -> None:
        for part in self.parts:
            part.close()


def _same_summary(a: StepSummary | None, b: StepSummary | None) -> bool:
    if a is None or b is None:
        return a is b
    return all(np.array_equal(x, y) for x, y in zip(a.arrays().values(), b.arrays().values(), strict=True))


def pool_connections(
    addresses: int, layout: Layout, block: range, blocks: list[tuple[range, int]]
) -> list[tuple[int, range, int]]:
    """(producer, the part of ``block`` it serves, how many trainers fetch from it) for each producer of a pool of
    ``addresses`` that serves part of ``block``; ``blocks``: every trainer's block with its number of ranks."""
    from .producer_assembly import share_of

    shares = [share_of(layout, p, addresses) for p in range(addresses)]
    out = []
    for p, own in enumerate(shares):
        part = range(max(block.start, own.start), min(block.stop, own.stop))
        if len(part):
            world = sum(ranks for other, ranks in blocks if max(other.start, own.start) < min(other.stop, own.stop))
            out.append((p, part, world))
    return out


def pool_addresses(address) -> list[str]:
    """data.producer.address: one producer's HOST:PORT, or a pool's (a list, or one string comma-separated)."""
    if address is None:
        return []
    items = [address] if isinstance(address, str) or not isinstance(address, Sequence) else list(address)
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


def trainer_layout(cfg, layout, accumulation: int, slot_samples: int, stages: int, costs: tuple) -> Layout:
    """What the trainers tell the producer; ``costs``: models.flops.flops_per_item of the model."""
    return Layout(
        slots=accumulation,
        samples_per_slot=slot_samples,
        groups=canonical_groups([u.dp for u in layout.units], slot_samples),
        stages=stages,
        world=layout.world_size,
        job=tuple(sorted(job_identity(cfg).items())),
        costs=tuple(costs),
    )


def resolve_key(cfg) -> bytes:
    value = cfg.data.producer.key or os.environ.get("DISTTRAIN_PRODUCER_KEY")
    if not value:
        raise ValueError(
            "data.producer.address is set but no key: pass data.producer.key=file:<path> (or hex:...) "
            "or set DISTTRAIN_PRODUCER_KEY"
        )
    return load_key(value)
