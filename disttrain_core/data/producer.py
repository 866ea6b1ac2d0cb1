"""Disaggregated data preprocessing: a producer service and the trainers' client.

The producer reads the one canonical sample stream (all shards, seeded shard order), plans
(parses and tokenizes) every sample in ``data.producer.workers`` worker processes, assembles
each global batch in stream order (so the batches do not depend on how many workers plan them),
reorders it (data/reorder.py: Algorithm 2 over the canonical DP grid, Algorithm 3 over the
microbatch slots), decodes the images of its share of the data-parallel groups (all of them
unless it is one of a pool: data/producer_assembly.py) and serves each trainer rank its unit
replica's block over the authenticated transport (data/transport.py), ``prefetch_steps``
batches ahead (docs/UNITS.md).

State: each batch comes with the stream position after it and the skip counters; trainers
save that with their checkpoints and tell a (re)started producer where to begin, so a resumed
run sees exactly the next global batches, and so does a run whose producer was restarted.

    train.py data.producer.workers=2                 # train.py starts a producer on 127.0.0.1
    train.py data.producer.workers=2 data.producer.count=2   # a pool of two, each decoding half
    python -m disttrain_core.launch.producer --listen 10.0.0.5:7070 --key file:/secrets/key [overrides]
    train.py data.producer.address=10.0.0.5:7070 data.producer.key=file:/secrets/key

The pieces: producer_protocol.py (layout, identity, batch frames), producer_assembly.py (plan,
reorder, decode a share), producer_server.py (the service), producer_client.py (the trainers'
``ProducerLoader`` and ``ProducerPool``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback

import torch

from ..base.processes import die_with_parent, end_helpers, watch_parent
from .producer_assembly import BatchAssembler, sample_costs, share_of  # noqa: F401
from .producer_client import ProducerLoader, resolve_key, trainer_layout  # noqa: F401  (the trainers' API)
from .producer_protocol import FIELDS, Layout, decode_batch, encode_batch, job_identity  # noqa: F401
from .producer_server import ProducerServer  # noqa: F401
from .transport import load_key

log = logging.getLogger(__name__)
STOP_SIGNAL = signal.SIGUSR2


def run_server(cfg, key: bytes, listen: str, ready=None, restart: int = 0) -> None:
    """Entry point of the producer process (``ready`` gets the bound address; ``restart``: which start)."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][producer][%(levelname)s] - %(message)s")
    server = ProducerServer(cfg, key, listen)
    server.restart = restart
    if ready is not None:
        ready.put(server.address)
    log.info("serving global batches on %s", server.address)
    server.serve_forever()


def _spawned(
    container: dict, key: str, listen: str, ready, parent: int, from_main_thread: bool, restart: int = 0
) -> None:
    from ..config import typed_config

    # SIGUSR2 stops the producer cleanly (its decode workers die with it); the kernel sends it when the
    # process that started this one dies, however it dies. SIGTERM and SIGINT are for the trainers: a
    # scheduler's preemption notice reaches every process of the job, and the ranks still fetch the
    # batch of the step they stop at (base/processes.py).
    signal.signal(STOP_SIGNAL, lambda *_: sys.exit(0))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not (from_main_thread and die_with_parent(parent, STOP_SIGNAL)):
        watch_parent(parent, STOP_SIGNAL)
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.set_num_threads(threads)
    code = 1
    try:
        run_server(typed_config(container), load_key(key), listen, ready, restart)
        code = 0
    except SystemExit as stop:  # STOP_SIGNAL
        code = 0 if stop.code in (None, 0) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        end_helpers()  # its decode workers ignore the SIGTERM multiprocessing would end them with at exit
        # No interpreter teardown: the assembling thread may be inside torch (collating a batch), and a thread
        # pool torn down under it aborts the process ("terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def stop_local_producer(process, timeout_s: float = 10) -> None:
    """Stop a producer ``start_local_producer`` started (it ignores SIGTERM)."""
    if process.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, STOP_SIGNAL)
    process.join(timeout=timeout_s)
    if process.is_alive():
        process.kill()
        process.join()


class LocalPool:
    """The producers ``train.py`` (or rank 0) starts (``data.producer.count``), supervised: one that dies is
    started again on its address (the trainers reconnect and continue from their position), at most
    ``data.producer.restarts`` times each; then its trainers stop after data.producer.timeout_s with the reason."""

    def __init__(self, cfg, container: dict, key: str):
        self.cfg, self.container, self.key = cfg, container, key
        self.processes, address = start_local_pool(cfg, container, key)
        self.address = address
        self.addresses = address.split(",")
        self.pids = {p.pid for p in self.processes}  # a live view (launchers.forward_stop_signals skips them)
        self.restarts = [0] * len(self.processes)
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="producer-pool", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        limit = int(self.cfg.data.producer.restarts)
        while not self._stopping.wait(0.5):
            for index, process in enumerate(self.processes):
                if process.is_alive() or self._stopping.is_set() or self.restarts[index] >= limit:
                    continue
                self.restarts[index] += 1
                where = self.addresses[index]
                log.warning(
                    "data producer %d of %d (pid %d) ended with exit code %s: starting it again on %s (restart %d of "
                    "%d, data.producer.restarts)",
                    index,
                    len(self.processes),
                    process.pid,
                    process.exitcode,
                    where,
                    self.restarts[index],
                    limit,
                )
                try:
                    new, ready = _start(self.cfg, self.container, self.key, where, self.restarts[index])
                    _ready(new, ready)
                except RuntimeError as error:
                    log.error("data producer %d did not start again on %s: %s", index, where, error)
                    continue
                self.pids.add(new.pid)
                self.processes[index] = new

    def stop(self) -> None:
        self._stopping.set()
        self._watcher.join(timeout=10)
        stop_local_pool(self.processes)


def start_local_pool(cfg, container: dict, key: str) -> tuple[list, str]:
    """``data.producer.count`` producer processes for ``train.py``; returns them and their addresses in pool
    order, comma-separated (what data.producer.address takes)."""
    starts = [_start(cfg, container, key) for _ in range(int(cfg.data.producer.count))]
    try:
        addresses = [_ready(process, ready) for process, ready in starts]
    except BaseException:
        stop_local_pool([process for process, _ in starts])
        raise
    return [process for process, _ in starts], ",".join(addresses)


def stop_local_pool(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, STOP_SIGNAL)
    for process in processes:
        stop_local_producer(process)


def start_local_producer(cfg, container: dict, key: str):
    """Start a producer process for ``train.py``; returns (process, address)."""
    process, ready = _start(cfg, container, key)
    return process, _ready(process, ready)


def _start(cfg, container: dict, key: str, listen: str | None = None, restart: int = 0):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready = ctx.SimpleQueue()
    # Not a daemon (its decode workers are child processes); it exits when the process that started it does.
    process = ctx.Process(
        target=_spawned,
        args=(
            container,
            key,
            listen or cfg.data.producer.listen,
            ready,
            os.getpid(),
            threading.current_thread() is threading.main_thread(),
            restart,
        ),
    )
    process.start()
    return process, ready


def _ready(process, ready) -> str:
    deadline = time.time() + 120
    while ready.empty():
        if not process.is_alive() or time.time() > deadline:
            raise RuntimeError("the data producer did not start (see its log above)")
        time.sleep(0.05)
    return ready.get()
