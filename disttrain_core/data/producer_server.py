"""The producer's side: global batches assembled in stream order, served to a job's trainer ranks.

Connections: at most ``data.producer.max_connections`` at once (one thread each; one more is
closed at once), and each must authenticate within ``data.producer.handshake_timeout_s``.

Sessions: one job's stream at a time. A HELLO carries the trainer's layout, identity and data
position (the step it last consumed and the stream position after it). It joins the current
session when the producer still holds (or is about to make) the step after that position and
agrees on the stream position; that covers a fresh job (all trainers send the same start),
all trainers reconnecting to a restarted producer (the first starts the stream at their common
position, the rest join), and one trainer reconnecting to a live producer. Otherwise it starts
a new session from its position when no trainer is connected (a job resumed from a checkpoint),
and is refused with the reason while other trainers are. A step's batch is dropped once
``world`` trainers have asked for a later step: synchronous training means every rank then has it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from ..base.net import split_address
from .blend import open_stream
from .loader import MicrobatchLoader, collate
from .producer_protocol import Layout, Want, encode_batch, encode_share, job_identity, job_mismatch, parse_hello
from .reorder import arrange
from .samples import SampleEncoder
from .transport import (
    BATCH,
    BYE,
    CONTROL_LIMIT,
    ERROR,
    HELLO,
    REQUEST,
    WELCOME,
    AuthenticationError,
    ProtocolError,
    server_channel,
)

log = logging.getLogger("disttrain_core.data.producer")


def sample_costs(costs: tuple, samples) -> list[float]:
    """Training work per sample in FLOPs from the trainers' per-item ``costs`` (Layout.costs): its images
    through the encoder, the LLM row, the generation target."""
    per_image, per_row, per_target = costs
    return [per_row + per_image * len(s.images) + per_target * float(s.gen_weight) for s in samples]


class BatchAssembler:
    """Global batches in stream order, reordered, with the state after each."""

    def __init__(self, cfg, layout: Layout, start: dict):
        self.cfg, self.layout = cfg, layout
        data, trainer = cfg.data, cfg.trainer
        try:
            stream = open_stream(data, trainer.seed)
        except ValueError as error:  # ShardStream: no shards to read
            where = "data.blend's sources" if data.blend else f"data.path={data.path!r}"
            raise FileNotFoundError(f"no .tar shards at {where} on the producer's host ({error})") from None
        from .tokenizer import build_tokenizer

        encoder = SampleEncoder(cfg.model, build_tokenizer(data.tokenizer), trainer.seed, data.max_image_pixels)
        self.batch_size = layout.slots * layout.samples_per_slot
        self.loader = MicrobatchLoader(
            stream,
            encoder,
            self.batch_size,
            1,
            num_workers=int(data.producer.workers),
            prefetch_steps=int(data.producer.prefetch_steps),
            state=start,
        )
        self.step = int(start.get("step", 0))

    def next(self):
        samples = [self.loader.next_sample() for _ in range(self.batch_size)]
        reorder = self.cfg.data.producer.reorder
        order = arrange(
            sample_costs(self.layout.costs, samples),
            self.layout.slots,
            self.layout.samples_per_slot,
            self.layout.groups,
            self.layout.stages,
            intra=bool(reorder.intra),
            inter=bool(reorder.inter),
        )
        batch = collate([samples[i] for i in order])
        self.step += 1
        return self.step, batch, {**self.loader.state_dict(), "step": self.step}

    def close(self) -> None:
        self.loader._items = None  # drops the DataLoader iterator: its decode workers exit


class Held:
    """One assembled step: its global batch, the stream state after it, and the frames made of it -- one per
    request trainers made (a Want: their block of every slot and the fields they read; ``None``: the whole batch)."""

    def __init__(self, step: int, batch, state: dict, slots: int):
        self.step, self.batch, self.state, self.slots = step, batch, state, slots
        self.frames: dict[Want | None, tuple[dict, bytes]] = {}
        self.lock = threading.Lock()

    def frame(self, want: Want | None) -> tuple[dict, bytes]:
        with self.lock:
            if want not in self.frames:
                if want is None:
                    meta, payload = encode_batch(self.batch)
                else:
                    meta, payload = encode_share(self.batch, self.slots, want)
                meta.update(step=self.step, state=self.state)
                self.frames[want] = (meta, payload)
            return self.frames[want]


class Session:
    """One job's stream: the batches held, what each trainer asked for, and the failure if any."""

    def __init__(self, layout: Layout, start: dict):
        self.layout, self.start = layout, start
        step = start["step"]
        self.first = step + 1  # lowest step still held (or the next to make)
        self.made = step  # last step assembled
        self.ready: dict[int, Held] = {}
        self.wants: set[Want | None] = set()  # what the trainers asked for: the assembler encodes these ahead
        self.position = {step: (start["epoch"], start["index"])}  # stream position after each step
        self.asked: dict[str, int] = {}  # trainer id -> last step it requested
        self.active = 0
        self.failure: str | None = None

    def servable(self, step: int, position: tuple) -> bool:
        """Can a trainer that consumed ``step`` (stream at ``position``) continue in this session?"""
        return self.first <= step + 1 <= self.made + 1 and self.position.get(step) == position

    def release(self) -> bool:
        """Drop the steps every trainer has moved past; True if any was dropped."""
        dropped = False
        while self.first in self.ready and sum(a > self.first for a in self.asked.values()) >= self.layout.world:
            del self.ready[self.first]
            self.position.pop(self.first - 1, None)
            self.first += 1
            dropped = True
        return dropped


class ProducerServer:
    """Serves global batches to trainer ranks; one thread per connection, one assembling thread."""

    def __init__(self, cfg, key: bytes, listen: str):
        self.cfg, self.key = cfg, key
        producer = cfg.data.producer
        self.sock = socket.create_server(split_address(listen))
        self.sock.settimeout(0.5)  # the accept loop looks at ``closed`` this often
        self.address = f"{self.sock.getsockname()[0]}:{self.sock.getsockname()[1]}"
        self.job = job_identity(cfg)
        self.max_connections = int(producer.max_connections)
        self.handshake_timeout = float(producer.handshake_timeout_s)
        self.prefetch = max(1, int(producer.prefetch_steps))
        self.lock = threading.Condition()
        self.session: Session | None = None
        self.connections: set[socket.socket] = set()
        self.closed = False
        self.rejected = 0  # connections dropped for a protocol error or a missed deadline
        self.refused = 0  # connections closed at once (max_connections reached)
        self._quiet_until = 0.0

    # ------------------------------------------------------------------ connections
    def serve_forever(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.closed:
                    return
                time.sleep(0.05)  # e.g. out of file descriptors: let connections finish
                continue
            with self.lock:
                full = len(self.connections) >= self.max_connections
                if not full:
                    self.connections.add(conn)
                else:
                    self.refused += 1
            if full:
                conn.close()
                self._note(f"refused a connection: {self.max_connections} open (data.producer.max_connections)")
                continue
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.session = None
            for conn in self.connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.lock.notify_all()
        self.sock.close()

    def _note(self, message: str) -> None:
        """A warning at most once a second (a flood of bad connections must not flood the log)."""
        now = time.monotonic()
        if now >= self._quiet_until:
            self._quiet_until = now + 1.0
            log.warning("%s (%d rejected, %d refused so far)", message, self.rejected, self.refused)

    def _connection(self, conn: socket.socket) -> None:
        session = None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            channel = server_channel(conn, self.key, CONTROL_LIMIT, time.monotonic() + self.handshake_timeout)
            try:
                kind, meta, _ = channel.recv()
            except AuthenticationError:
                # Tell the trainer (it cannot verify this frame either, and reports "another key").
                channel.send(ERROR, {"error": "authentication failed"})
                raise
            if kind != HELLO:
                raise ProtocolError("expected HELLO")
            try:
                layout, start, trainer, job, want = parse_hello(meta)
            except ProtocolError as error:  # an authenticated trainer: tell it what was wrong
                channel.send(ERROR, {"error": str(error)})
                raise
            problem = job_mismatch(self.job, job)
            if problem is None:
                session, problem = self._join(layout, start, trainer, want)
            if problem is not None:
                log.warning("refused a trainer: %s", problem)
                channel.send(ERROR, {"error": problem})
                return
            channel.send(WELCOME, {"step": start["step"]})
            channel.deadline = None  # authenticated: a trainer may take as long as it needs between steps
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            expected = start["step"] + 1
            while True:
                kind, meta, _ = channel.recv()
                if kind == BYE:
                    return
                if kind != REQUEST or meta.get("step") != expected:
                    raise ProtocolError(f"expected REQUEST for step {expected}")
                held, problem = self._fetch(session, trainer, expected)
                if problem is not None:
                    channel.send(ERROR, {"error": problem})
                    return
                channel.send(BATCH, *held.frame(want))
                expected += 1
        except (ProtocolError, TimeoutError) as error:
            with self.lock:
                self.rejected += 1
            self._note(f"dropped a connection: {error}")
        except (ConnectionError, OSError):
            pass
        finally:
            with self.lock:
                if session is not None:
                    session.active -= 1
                self.connections.discard(conn)
            conn.close()

    # ------------------------------------------------------------------ sessions
    def _join(self, layout: Layout, start: dict, trainer: str, want: Want | None) -> tuple[Session | None, str | None]:
        step, position = start["step"], (start["epoch"], start["index"])
        with self.lock:
            current = self.session
            if current is not None and current.active > 0:
                if current.failure is not None:
                    return None, current.failure
                if current.layout != layout:
                    return None, (
                        f"the producer serves another layout to {current.active} connected trainer(s) "
                        f"({current.layout.to_dict()}; this trainer has {layout.to_dict()})"
                    )
                if not current.servable(step, position):
                    return None, (
                        f"this trainer continues after step {step} (epoch {position[0]}, index {position[1]}), but "
                        f"the producer serves steps {current.first}-{current.made + 1} to {current.active} "
                        "other trainer(s) of its job"
                    )
            elif current is None or current.failure or current.layout != layout or not current.servable(step, position):
                # a new job, one resumed after all its trainers left, or another try after a failure
                current = self.session = Session(layout, start)
                threading.Thread(target=self._assemble, args=(current,), daemon=True).start()
                log.info("new session: %s from step %d (epoch %d, index %d)", layout.to_dict(), step, *position)
            current.active += 1
            current.asked.setdefault(trainer, step)
            current.wants.add(want)
            return current, None

    def _fetch(self, session: Session, trainer: str, step: int) -> tuple[Held | None, str | None]:
        with self.lock:
            session.asked[trainer] = max(session.asked.get(trainer, step), step)
            if session.release():
                self.lock.notify_all()
            while step not in session.ready and session.failure is None:
                if session is not self.session:
                    return None, "the producer began a new session (another job) and stopped this one"
                if step < session.first:
                    return None, f"step {step} is no longer held (the producer holds {session.first} on)"
                self.lock.wait(timeout=1.0)
            if session.failure is not None:
                return None, session.failure
            return session.ready[step], None

    def _assemble(self, session: Session) -> None:
        assembler = None
        try:
            assembler = BatchAssembler(self.cfg, session.layout, session.start)
            while True:
                with self.lock:
                    while len(session.ready) > self.prefetch and session is self.session:
                        self.lock.wait(timeout=1.0)
                    if session is not self.session:
                        return
                step, batch, state = assembler.next()
                held = Held(step, batch, state, session.layout.slots)
                with self.lock:
                    wants = list(session.wants)
                for want in wants:  # encoded ahead of the requests, off the trainers' critical path
                    held.frame(want)
                with self.lock:
                    session.ready[step] = held
                    session.position[step] = (state["epoch"], state["index"])
                    session.made = step
                    self.lock.notify_all()
        except Exception as error:  # reported to every trainer of the session instead of a silent stall
            log.exception("the producer cannot assemble batches")
            with self.lock:
                session.failure = f"cannot assemble batches: {type(error).__name__}: {error}"
                self.lock.notify_all()
        finally:
            if assembler is not None:
                assembler.close()
