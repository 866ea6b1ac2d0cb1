"""The producer's side: global batches assembled in stream order, served to a job's trainer ranks.

Connections: at most ``data.producer.max_connections`` at once (one thread each; one more is
closed at once), and each must authenticate within ``data.producer.handshake_timeout_s``.

Sessions: one job's stream at a time. A HELLO carries the trainer's layout, identity and data
position (the step it last consumed and the stream position after it). It joins the current
session when the producer still holds (or is about to make) the step after that position and
agrees on the stream position; that covers a fresh job (all trainers send the same start),
all trainers reconnecting to a restarted producer, and one trainer reconnecting to a live
producer. Otherwise it starts a new session from its position when no trainer is connected (a
job resumed from a checkpoint), and is refused with the reason while other trainers are.

A new session assembles nothing until its ``world`` trainers have joined (or ``START_GRACE_S``
after the first): the trainers of a restarted producer come back one step apart (some fetched
the step it died after, some not), and the stream starts at the earliest; a trainer ahead of it
is checked against the stream when the session gets to its step. A step's batch is dropped once
``world`` trainers have asked for a later step: synchronous training means every rank then has it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from ..base.faults import inject
from ..base.net import split_address
from .producer_assembly import Assembled, BatchAssembler, share_of
from .producer_protocol import Layout, Want, encode_batch, encode_share, job_identity, job_mismatch, parse_hello
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
START_GRACE_S = 3.0  # a new session waits this long for all its trainers before assembling from the earliest
MAX_AHEAD = 2  # steps a trainer may be ahead of what its session made (synchronous ranks are within one)


class Held:
    """One assembled step: this producer's share of its global batch (``own``: those samples of every slot), the
    stream state after it, the whole batch's summary, and the frames made of it -- one per request trainers made
    (a Want: their block of every slot and the fields they read; ``None``: the whole batch)."""

    def __init__(self, assembled: Assembled, slots: int, own: range):
        self.step, self.batch, self.state = assembled.step, assembled.batch, assembled.state
        self.summary, self.slots, self.own = assembled.summary, slots, own
        self.frames: dict[Want | None, tuple[dict, bytes]] = {}
        self.lock = threading.Lock()

    def frame(self, want: Want | None) -> tuple[dict, bytes]:
        with self.lock:
            if want not in self.frames:
                if want is None:
                    meta, payload = encode_batch(self.batch)
                else:
                    meta, payload = encode_share(self.batch, self.slots, want, self.summary, self.own.start)
                meta.update(step=self.step, state=self.state)
                self.frames[want] = (meta, payload)
            return self.frames[want]


class Session:
    """One job's stream: the batches held, what each trainer asked for, and the failure if any."""

    def __init__(self, layout: Layout, start: dict, share: tuple[int, int] = (0, 1)):
        self.layout, self.start, self.share = layout, start, share
        self.own = share_of(layout, *share)
        step = start["step"]
        self.first = step + 1  # lowest step still held (or the next to make)
        self.made = step  # last step assembled
        self.ready: dict[int, Held] = {}
        self.wants: set[Want | None] = set()  # what the trainers asked for: the assembler encodes these ahead
        self.position = {step: (start["epoch"], start["index"])}  # stream position after each step
        self.asked: dict[str, int] = {}  # trainer id -> last step it requested
        self.ahead: dict[str, tuple[int, tuple]] = {}  # trainer id -> (step, position) to check once made
        self.joined: dict[str, tuple[int, tuple]] = {}  # trainer id -> (step, position) it joined at
        self.started = False  # assembling: once ``world`` trainers joined, or START_GRACE_S after the first
        self.opened = time.monotonic()
        self.active = 0
        self.failure: str | None = None

    def servable(self, step: int, position: tuple, ahead: bool = False) -> bool:
        """Can a trainer that consumed ``step`` (stream at ``position``) continue in this session? With ``ahead``,
        also one past what the session made (trainers of a restarted producer do not all reconnect at the same
        step): its position is checked when the session gets there."""
        if ahead and self.made < step <= self.made + MAX_AHEAD:
            return True
        return self.first <= step + 1 <= self.made + 1 and self.position.get(step) == position

    def add(self, trainer: str, start: dict) -> str | None:
        """Count a trainer in; None, or why its position contradicts the session's. Until the session starts
        assembling, a trainer behind its start moves the start back to it (the others are then ahead)."""
        step, position = start["step"], (start["epoch"], start["index"])
        if not self.started and step < self.made:
            for other, (at, where) in self.joined.items():
                if at > step:
                    self.ahead[other] = (at, where)
            self.start, self.first, self.made, self.position = start, step + 1, step, {step: position}
        elif step == self.made and self.position.get(step) != position:
            return (
                f"this trainer continues after step {step} at stream position {position}, but the producer's other "
                f"trainers are at {self.position.get(step)} there"
            )
        elif step > self.made + MAX_AHEAD:
            return (
                f"this trainer continues after step {step}, but the producer's other trainers continue after step "
                f"{self.made}"
            )
        elif step > self.made:
            self.ahead[trainer] = (step, position)
        self.joined[trainer] = (step, position)
        self.asked.setdefault(trainer, step)
        return None

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
        self.restart = 0  # which start of this producer (base/faults.py: a drill's fault hits one start)
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
                layout, start, trainer, job, want, share = parse_hello(meta)
            except ProtocolError as error:  # an authenticated trainer: tell it what was wrong
                channel.send(ERROR, {"error": str(error)})
                raise
            problem = job_mismatch(self.job, job)
            if problem is None:
                session, problem = self._join(layout, start, trainer, want, share)
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
    def _join(
        self, layout: Layout, start: dict, trainer: str, want: Want | None, share: tuple[int, int]
    ) -> tuple[Session | None, str | None]:
        step, position = start["step"], (start["epoch"], start["index"])
        own = share_of(layout, *share)
        if (want is None and len(own) < layout.samples_per_slot) or (
            want is not None and not own.start <= want.block.start < want.block.stop <= own.stop
        ):
            asked = "the whole batch" if want is None else f"samples {want.block.start}-{want.block.stop - 1}"
            return None, (
                f"this producer (share {share[0]} of a pool of {share[1]}) serves samples {own.start}-{own.stop - 1} "
                f"of every slot; the trainer asked for {asked}"
            )
        with self.lock:
            current = self.session
            if current is not None and current.active > 0:
                if current.failure is not None:
                    return None, current.failure
                if current.layout != layout or current.share != share:
                    layout_text = f"{layout.to_dict()} as share {share[0]} of {share[1]}"
                    return None, (
                        f"the producer serves another layout to {current.active} connected trainer(s) "
                        f"({current.layout.to_dict()} as share {current.share[0]} of {current.share[1]}; this trainer "
                        f"has {layout_text})"
                    )
                if current.started and not current.servable(step, position, ahead=True):
                    return None, (
                        f"this trainer continues after step {step} (epoch {position[0]}, index {position[1]}), but "
                        f"the producer serves steps {current.first}-{current.made + 1} to {current.active} "
                        "other trainer(s) of its job"
                    )
            elif (
                current is None
                or current.failure
                or (current.layout, current.share) != (layout, share)
                or not current.servable(step, position)
            ):
                # a new job, one resumed after all its trainers left, or another try after a failure
                current = self.session = Session(layout, start, share)
                log.info("new session: %s from step %d (epoch %d, index %d)", layout.to_dict(), step, *position)
            problem = current.add(trainer, start)
            if problem is not None:
                return None, problem
            current.active += 1
            current.wants.add(want)
            if not current.started and len(current.joined) >= layout.world:
                self._start_assembly(current)
            return current, None

    def _start_assembly(self, session: Session) -> None:
        session.started = True
        threading.Thread(target=self._assemble, args=(session,), daemon=True).start()

    def _fetch(self, session: Session, trainer: str, step: int) -> tuple[Held | None, str | None]:
        with self.lock:
            session.asked[trainer] = max(session.asked.get(trainer, step), step)
            if session.release():
                self.lock.notify_all()
            while step not in session.ready and session.failure is None:
                if not session.started and time.monotonic() - session.opened > START_GRACE_S:
                    self._start_assembly(session)  # not every trainer came back: start with those that did
                if session is not self.session:
                    return None, "the producer began a new session (another job) and stopped this one"
                if step < session.first:
                    return None, f"step {step} is no longer held (the producer holds {session.first} on)"
                self.lock.wait(timeout=1.0)
            if session.failure is not None:
                return None, session.failure
            if trainer in session.ahead:  # it joined ahead of the session: was its stream this one?
                joined, position = session.ahead.pop(trainer)
                if session.position.get(joined) != position:
                    return None, (
                        f"this trainer continues after step {joined} at stream position {position}, but the "
                        f"producer's stream was at {session.position.get(joined)} there"
                    )
            return session.ready[step], None

    def _assemble(self, session: Session) -> None:
        assembler = None
        try:
            assembler = BatchAssembler(self.cfg, session.layout, session.start, session.share)
            while True:
                with self.lock:
                    while len(session.ready) > self.prefetch and session is self.session:
                        self.lock.wait(timeout=1.0)
                    if session is not self.session:
                        return
                assembled = assembler.next()
                step, state = assembled.step, assembled.state
                held = Held(assembled, session.layout.slots, session.own)
                with self.lock:
                    wants = list(session.wants)
                for want in wants:  # encoded ahead of the requests, off the trainers' critical path
                    held.frame(want)
                with self.lock:
                    session.ready[step] = held
                    session.position[step] = (state["epoch"], state["index"])
                    session.made = step
                    self.lock.notify_all()
                inject("produce", session.share[0], step, self.restart)
        except Exception as error:  # reported to every trainer of the session instead of a silent stall
            log.exception("the producer cannot assemble batches")
            with self.lock:
                session.failure = f"cannot assemble batches: {type(error).__name__}: {error}"
                self.lock.notify_all()
        finally:
            if assembler is not None:
                assembler.close()
