"""Disaggregated data preprocessing: a producer service and the trainers' client.

The producer reads the one canonical sample stream (all shards, seeded shard order), decodes
and tokenizes in ``data.producer.workers`` worker processes, assembles each global batch in
stream order (so the batches do not depend on how many workers decode them), reorders it
(data/reorder.py: Algorithm 2 over the canonical DP grid, Algorithm 3 over the microbatch
slots), and serves it to every trainer rank over the authenticated transport
(data/transport.py), ``prefetch_steps`` batches ahead. A trainer rank keeps its unit
replica's block of every slot (docs/UNITS.md); the sample -> replica mapping is the order the
producer sends, which every unit reads alike.

State: each batch comes with the stream position after it and the skip counters; trainers
save that with their checkpoints and tell a (re)started producer where to begin, so a resumed
run sees exactly the next global batches.

    train.py data.producer.workers=2                 # train.py starts a producer on 127.0.0.1
    python -m disttrain_core.data.producer --listen 0.0.0.0:7070 --key file:/secrets/key [overrides]
    train.py data.producer.address=HOST:7070 data.producer.key=file:/secrets/key
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

import torch

from .batch import Batch
from .loader import MicrobatchLoader, collate
from .reader import ShardStream, resolve_shards
from .reorder import arrange, canonical_groups
from .samples import SampleEncoder
from .transport import (
    BATCH,
    BYE,
    ERROR,
    HELLO,
    REQUEST,
    ProtocolError,
    client_channel,
    load_key,
    pack_arrays,
    server_channel,
    unpack_arrays,
)

log = logging.getLogger(__name__)

FIELDS = ("tokens", "labels", "images", "image_counts", "gen_images", "gen_weight", "gen_noise", "gen_timesteps")


@dataclass(frozen=True)
class Layout:
    """What the producer needs to know about the trainers to arrange a global batch."""

    slots: int  # microbatch slots per step
    samples_per_slot: int
    groups: int  # canonical DP grid (lcm of the units' DP sizes)
    stages: int  # pipeline stages (1F1B), for Algorithm 3
    world: int  # trainer ranks that fetch every batch

    @classmethod
    def from_dict(cls, raw: dict) -> Layout:
        try:
            return cls(**{k: int(raw[k]) for k in ("slots", "samples_per_slot", "groups", "stages", "world")})
        except (KeyError, TypeError, ValueError) as error:
            raise ProtocolError(f"bad layout in HELLO: {error}") from error


def sample_costs(cfg, samples) -> list[float]:
    """Training work per sample in FLOPs: its images through the encoder, the LLM row, the generator."""
    from ..models.flops import module_flops

    flops = module_flops(cfg.model)
    per_image = sum(f.train for n, f in flops.items() if f.unit == "image")
    per_row = sum(f.train for n, f in flops.items() if f.unit == "sequence")
    per_target = sum(f.train for n, f in flops.items() if f.unit == "sample")
    return [per_row + per_image * len(s.images) + per_target * float(s.gen_weight) for s in samples]


class BatchAssembler:
    """Global batches in stream order, reordered, with the state after each."""

    def __init__(self, cfg, layout: Layout, start: dict):
        self.cfg, self.layout = cfg, layout
        data, trainer = cfg.data, cfg.trainer
        stream = ShardStream(resolve_shards(data.path), 0, 1, seed=trainer.seed, shuffle=data.shuffle_shards)
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

    def next(self) -> tuple[int, Batch, dict]:
        samples = [self.loader.next_sample() for _ in range(self.batch_size)]
        reorder = self.cfg.data.producer.reorder
        order = arrange(
            sample_costs(self.cfg, samples),
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


def encode_batch(batch: Batch) -> tuple[dict, bytes]:
    tables, payload = pack_arrays({name: getattr(batch, name).numpy() for name in FIELDS})
    return {"tensors": tables, "keys": list(batch.keys)}, payload


def decode_batch(meta: dict, payload: bytes) -> Batch:
    arrays = unpack_arrays(meta.get("tensors"), payload)
    missing = [name for name in FIELDS if name not in arrays]
    if missing:
        raise ProtocolError(f"batch without {missing}")
    keys = meta.get("keys")
    if not isinstance(keys, list) or len(keys) != arrays["tokens"].shape[0]:
        raise ProtocolError("batch keys do not match its rows")
    return Batch(**{name: torch.from_numpy(arrays[name]) for name in FIELDS}, keys=[str(k) for k in keys])


# ------------------------------------------------------------------------------------- server
class ProducerServer:
    """Serves global batches to trainer ranks; one thread per connection, one assembling thread."""

    def __init__(self, cfg, key: bytes, listen: str):
        self.cfg, self.key = cfg, key
        host, _, port = listen.rpartition(":")
        self.sock = socket.create_server((host or "127.0.0.1", int(port)))
        self.address = f"{self.sock.getsockname()[0]}:{self.sock.getsockname()[1]}"
        self.limit = int(cfg.data.producer.max_frame_mb) << 20
        self.lock = threading.Condition()
        self.assembler: BatchAssembler | None = None
        self.session: tuple | None = None
        self.ready: dict[int, tuple[dict, bytes]] = {}  # step -> (meta, payload)
        self.served: dict[int, int] = {}
        self.failure: str | None = None
        self.rejected = 0
        self.active = 0  # trainer connections past HELLO

    def serve_forever(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _start(self, layout: Layout, start: dict) -> None:
        """Begin (or join) the session the first HELLO describes; later ones must agree."""
        session = (layout, tuple(sorted((k, str(v)) for k, v in start.items())))
        with self.lock:
            if self.session is None or (self.active == 0 and self.session != session):
                # a new job, or the same job resumed after all its trainers left: start over
                self.session = session
                self.ready.clear()
                self.served.clear()
                self.failure = None
                self.assembler = BatchAssembler(self.cfg, layout, start)
                threading.Thread(target=self._assemble, daemon=True).start()
            elif self.session != session:
                raise ProtocolError("a trainer asked for a different layout or start than its peers")
            self.active += 1

    def _assemble(self) -> None:
        assembler = self.assembler
        prefetch = max(1, int(self.cfg.data.producer.prefetch_steps))
        try:
            while assembler is self.assembler:
                with self.lock:
                    while len(self.ready) >= prefetch and assembler is self.assembler:
                        self.lock.wait(timeout=1.0)
                step, batch, state = assembler.next()
                meta, payload = encode_batch(batch)
                meta.update(step=step, state=state)
                with self.lock:
                    if assembler is not self.assembler:
                        return  # a new session replaced this one while the batch was being made
                    self.ready[step] = (meta, payload)
                    self.lock.notify_all()
        except Exception as error:  # reported to every trainer instead of a silent stall
            log.exception("the producer failed")
            with self.lock:
                self.failure = f"{type(error).__name__}: {error}"
                self.lock.notify_all()

    def _connection(self, conn: socket.socket) -> None:
        timeout = float(self.cfg.data.producer.timeout_s)
        conn.settimeout(timeout)
        joined = False
        try:
            channel = server_channel(conn, self.key, self.limit)
            kind, meta, _ = channel.recv()
            if kind != HELLO:
                raise ProtocolError("expected HELLO")
            layout = Layout.from_dict(meta.get("layout") or {})
            start = meta.get("start") or {}
            if not isinstance(start, dict):
                raise ProtocolError("bad start state")
            self._start(layout, start)
            joined = True
            conn.settimeout(None)
            while True:
                kind, meta, _ = channel.recv()
                if kind == BYE:
                    return
                if kind != REQUEST or not isinstance(meta.get("step"), int):
                    raise ProtocolError("expected REQUEST with an integer step")
                step = meta["step"]
                with self.lock:
                    while step not in self.ready and self.failure is None:
                        self.lock.wait(timeout=1.0)
                    if self.failure is not None:
                        channel.send(ERROR, {"error": self.failure})
                        return
                    reply_meta, payload = self.ready[step]
                    self.served[step] = self.served.get(step, 0) + 1
                    if self.served[step] >= layout.world:  # everyone has it: make room for the next
                        del self.ready[step]
                        del self.served[step]
                        self.lock.notify_all()
                channel.send(BATCH, reply_meta, payload)
        except ProtocolError as error:
            self.rejected += 1
            log.warning("rejected a connection: %s", error)
        except (ConnectionError, OSError, TimeoutError):
            pass
        finally:
            if joined:
                with self.lock:
                    self.active -= 1
            conn.close()


def run_server(cfg, key: bytes, listen: str, ready=None) -> None:
    """Entry point of the producer process (``ready`` gets the bound address)."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][producer][%(levelname)s] - %(message)s")
    server = ProducerServer(cfg, key, listen)
    if ready is not None:
        ready.put(server.address)
    log.info("serving global batches on %s", server.address)
    server.serve_forever()


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler below exits cleanly, workers included


def _spawned(container: dict, key: str, listen: str, ready, parent: int) -> None:  # pragma: no cover
    from omegaconf import OmegaConf

    from ..config import Config

    # A clean exit on SIGTERM: multiprocessing then stops the decode workers too (no orphans).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.set_num_threads(threads)
    cfg = OmegaConf.merge(OmegaConf.structured(Config), container)
    run_server(cfg, load_key(key), listen, ready)


def start_local_producer(cfg, container: dict, key: str):
    """Start a producer process for ``train.py``; returns (process, address)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready = ctx.SimpleQueue()
    # Not a daemon (its decode workers are child processes); it exits when train.py does.
    process = ctx.Process(target=_spawned, args=(container, key, cfg.data.producer.listen, ready, os.getpid()))
    process.start()
    deadline = time.time() + 120
    while ready.empty():
        if not process.is_alive() or time.time() > deadline:
            raise RuntimeError("the data producer did not start (see its log above)")
        time.sleep(0.05)
    return process, ready.get()


# ------------------------------------------------------------------------------------- client
class ProducerLoader:
    """The trainer's side: global batches from a producer, split into microbatch slots."""

    def __init__(self, address: str, key: bytes, layout: Layout, start: dict | None, timeout_s: float, limit: int):
        self.address, self.timeout = address, timeout_s
        self.layout = layout
        self.state = dict(start or {})
        self.step = int(self.state.get("step", 0))
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except OSError as error:
            raise RuntimeError(f"cannot reach the data producer at {address}: {error}") from error
        sock.settimeout(timeout_s)
        self.channel = client_channel(sock, key, limit)
        self.channel.send(HELLO, {"layout": layout.__dict__, "start": self.state})
        self.skipped: dict[str, int] = dict(self.state.get("skipped", {}))
        self.truncated_images = int(self.state.get("truncated_images", 0))

    def next_step(self) -> list[Batch]:
        try:
            self.channel.send(REQUEST, {"step": self.step + 1})
            kind, meta, payload = self.channel.recv()
        except TimeoutError as error:
            raise RuntimeError(
                f"the data producer at {self.address} sent nothing for {self.timeout:.0f} s "
                "(data.producer.timeout_s): is it alive?"
            ) from error
        except (ConnectionError, OSError) as error:
            raise RuntimeError(f"lost the data producer at {self.address}: {error}") from error
        if kind == ERROR:
            raise RuntimeError(f"the data producer failed: {meta.get('error')}")
        if kind != BATCH or meta.get("step") != self.step + 1:
            raise RuntimeError(f"the data producer sent frame {kind} for step {meta.get('step')}")
        batch = decode_batch(meta, payload)
        self.step += 1
        self.state = dict(meta.get("state") or {})
        self.skipped = dict(self.state.get("skipped", {}))
        self.truncated_images = int(self.state.get("truncated_images", 0))
        per = self.layout.samples_per_slot
        return [batch.select(range(k * per, (k + 1) * per)) for k in range(self.layout.slots)]

    def state_dict(self) -> dict:
        return dict(self.state)

    def close(self) -> None:
        try:
            self.channel.send(BYE, {})
        except OSError:
            pass


def trainer_layout(cfg, layout, accumulation: int, slot_samples: int, stages: int) -> Layout:
    return Layout(
        slots=accumulation,
        samples_per_slot=slot_samples,
        groups=canonical_groups([u.dp for u in layout.units], slot_samples),
        stages=stages,
        world=layout.world_size,
    )


def resolve_key(cfg) -> bytes:
    value = cfg.data.producer.key or os.environ.get("DISTTRAIN_PRODUCER_KEY")
    if not value:
        raise ValueError(
            "data.producer.address is set but no key: pass data.producer.key=file:<path> (or hex:...) "
            "or set DISTTRAIN_PRODUCER_KEY"
        )
    return load_key(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:7070", help="HOST:PORT to bind (default 127.0.0.1:7070)")
    parser.add_argument("--key", default=None, help="hex:<hex>, file:<path>; default $DISTTRAIN_PRODUCER_KEY")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for train.py (model, data, ...)")
    args = parser.parse_args(argv)
    from ..config import compose

    cfg = compose(args.overrides)
    key = args.key or os.environ.get("DISTTRAIN_PRODUCER_KEY")
    if not key:
        print("error: give --key (hex:... or file:...) or set DISTTRAIN_PRODUCER_KEY", file=sys.stderr)
        return 2
    run_server(cfg, load_key(key), args.listen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
