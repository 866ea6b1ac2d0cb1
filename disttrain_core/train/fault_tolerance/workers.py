"""Local-SGD workers as replica groups: DiLoCo (or post-local-SGD) under ``trainer.fault_tolerance``
(docs/FAULT_TOLERANCE.md, "Local SGD").

Each replica group is one local-SGD worker (``parallel.mode=local_sgd``, DDP inside the worker). Between syncs
the workers do not talk to each other: a worker takes its fixed share of every step (worker ``w`` of ``W``:
microbatches ``[w*A//W, (w+1)*A//W)`` of the step's ``A``), steps its inner optimizer and never meets a quorum.
At a sync the workers meet through torchft's quorum and sum their pseudo-gradients with its fault-tolerant
all-reduce; the outer step is applied only if the quorum's vote commits it.

The same math through a worker's death: the sync waits for every worker the launcher has not given up on. The
dead worker's replacement takes the worker's state as of the last sync -- its parameters (the anchors), its inner
optimizer, the outer momentum, the step and the data position -- from the next worker in the ring, which copied
it from the dead worker right after that sync (live, never from disk). The replacement replays the local steps
since, on the same samples, reaches the sync, and the sync goes on with every worker: the synced model is the
one a run without the failure syncs. Cost: every process holds one extra copy of its predecessor's model and
inner-optimizer state in host memory, and each sync pulls it once over the authenticated state transport.

Where the copy cannot be exact it says so: a worker given up on (``replace_timeout_s``, ``max_replacements``) leaves
the syncs, which average over the workers that remain (seed 003's elastic rule: the outer step does not
depend on their number); a worker that died while its successor copied it returns with its successor's inner
optimizer state (a warning names it).

The job store (a TCPStore the launcher serves, ``DISTTRAIN_FT_JOB_STORE``) holds small text values only: each
worker's last sync step reached (``at/<w>``, removed by the launcher when the worker dies), the workers given up
on (``given_up/<w>``), the newest sync whose copy of worker ``w`` its successor serves (``backup/<w>``), and the
state transports' addresses.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch

from ...base.faults import inject
from ...base.net import split_address
from ...data.transport import ProtocolError

log = logging.getLogger(__name__)

JOB_STORE_ENV = "DISTTRAIN_FT_JOB_STORE"  # host:port of the job's store (the launcher serves it)
SYNCED_KEY = "ft/synced"  # the newest committed sync's step
POLL_S = 0.05
TRANSFER_ERRORS = (OSError, RuntimeError, ProtocolError, TimeoutError, ValueError)


def at_key(worker: int) -> str:
    return f"ft/at/{worker}"


def given_up_key(worker: int) -> str:
    return f"ft/given_up/{worker}"


def backup_key(worker: int) -> str:
    return f"ft/backup/{worker}"


def address_key(kind: str, worker: int, rank: int) -> str:
    return f"ft/address/{kind}/{worker}/{rank}"


def worker_share(microbatches: list, worker: int, workers: int) -> list:
    """Microbatches ``[w*A//W, (w+1)*A//W)`` of a step's ``A``: a contiguous share, none lost or repeated."""
    total = len(microbatches)
    return microbatches[worker * total // workers : (worker + 1) * total // workers]


class WorkerReplicas:
    """This process's part in a fault-tolerant local-SGD job (module docstring). ``member``: its
    ReplicaGroupMember (train/fault_tolerance/replica.py)."""

    def __init__(self, member, key: bytes):
        from .transport import HealTransport

        trainer, ft = member.trainer, member.trainer.cfg.trainer.fault_tolerance
        self.member, self.trainer, self.manager = member, trainer, member.manager
        self.workers, self.worker, self.rank = ft.replicas, member.replica, trainer.rank
        self.timeout = timedelta(seconds=ft.timeout_s)
        host, port = split_address(os.environ[JOB_STORE_ENV])
        self.store = torch.distributed.TCPStore(
            host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=ft.quorum_timeout_s)
        )
        # own: this worker's state at its last sync (its successor copies it); held: the predecessor's copy
        self.own = HealTransport(key, bind=ft.bind, timeout=ft.timeout_s)
        self.held = HealTransport(key, bind=ft.bind, timeout=ft.timeout_s)
        for kind, transport in (("own", self.own), ("held", self.held)):
            self.store.set(address_key(kind, self.worker, self.rank), transport.metadata())
        self.restored_from: int | None = None  # the sync step a replacement took its worker's state at
        self.inexact: list[str] = []  # why a restored or backed-up state is not the worker's own (warnings)
        self.waited_s = 0.0  # time spent at syncs waiting for workers (a replacement's start and replay)
        self.failed_syncs = 0  # syncs a worker died in: nothing applied, taken again

    # ------------------------------------------------------------------ the store
    def _given_up(self) -> set[int]:
        return {w for w in range(self.workers) if self.store.check([given_up_key(w)])}

    def _reached(self, worker: int, step: int) -> bool:
        key = at_key(worker)
        if not self.store.check([key]):
            return False
        try:
            return int(self.store.get(key)) >= step
        except ValueError:  # the launcher deleted it between the check and the read (the worker died): b""
            return False

    def _wait_for_workers(self, step: int) -> set[int]:
        """Until every worker not given up has reached sync ``step``; returns the ones given up on."""
        started = time.monotonic()
        while True:
            gone = self._given_up()
            if all(w in gone or self._reached(w, step) for w in range(self.workers)):
                self.waited_s += time.monotonic() - started
                return gone
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ the sync
    def sync(self, engine) -> None:
        """The outer step at ``engine.step``: every worker not given up in the quorum, the pseudo-gradients summed
        over it and divided by its size, applied only if the vote commits; then the ring copy."""
        step = engine.step
        self.store.set(at_key(self.worker), str(step))
        manager = self.manager
        while True:
            expected = self.workers - len(self._wait_for_workers(step))
            manager.start_quorum()
            participants = manager.num_participants()
            if participants < expected:  # a worker's death is not yet seen by the launcher: wait for its successor
                time.sleep(POLL_S)
                continue
            engine.outer.workers = participants
            if engine.outer.sync_voted(self._allreduce, manager.should_commit):
                break
            self.failed_syncs += 1  # a worker died in the sync: nothing was applied; wait for its replacement
            if self.rank == 0:
                log.warning("local-SGD worker %d: the sync at step %d did not commit; taken again", self.worker, step)
        self.member.quorum_sizes[step] = participants
        self._back_up(engine, step)

    def _allreduce(self, flat: torch.Tensor):
        inject("allreduce", self.rank, self.trainer.step + 1)  # fault drills: before this worker's part is sent
        return self.manager.allreduce(flat, reduce_op=torch.distributed.ReduceOp.SUM)

    def _back_up(self, engine, step: int) -> None:
        """Serve this worker's synced state, copy the predecessor's and serve that for its replacement."""
        own = {
            "tensors": engine.checkpoint_state(saving=False),
            "step": self.trainer.step + 1,  # the loop counts the step after the engine's sync
            "data": self.trainer.loader.state_dict(),
            "manager_step": self.manager.current_step(),
        }
        self.own.send_checkpoint([], step, own, self.timeout)
        self.store.set(SYNCED_KEY, str(step))
        predecessor = (self.worker - 1) % self.workers
        if predecessor == self.worker or predecessor in self._given_up():
            return
        if step >= int(self.trainer.cfg.trainer.max_steps):
            # the run's last sync: no replacement follows, and the predecessor may have finished and closed its
            # server already (seen as an inexact copy when a loaded machine slowed this worker)
            return
        try:
            address = self.store.get(address_key("own", predecessor, self.rank)).decode()
            held = self.own.recv_checkpoint(predecessor, address, step, self.timeout)
        except TRANSFER_ERRORS as error:  # its replacement will take another worker's inner optimizer state
            why = f"worker {predecessor}'s state at step {step} could not be copied ({error})"
            self.inexact.append(why)
            log.warning("local-SGD worker %d: %s", self.worker, why)
            return
        self.held.send_checkpoint([], step, held, self.timeout)
        self.store.set(backup_key(predecessor), str(step))

    # ------------------------------------------------------------------ a replacement
    def restore(self) -> None:
        """A replacement: the worker's state at the last committed sync, from the next worker in the ring, which
        copied it then (before the first step; with no sync committed yet the worker starts from the beginning,
        as it first did). If that copy is gone -- the successor died since, or the worker died while being
        copied -- another worker's state at that sync: the same parameters, the other's inner optimizer state."""
        # this worker held its predecessor's copy, which died with its previous start
        self.store.set(backup_key((self.worker - 1) % self.workers), "lost")
        if not self.store.check([SYNCED_KEY]):
            return
        ft = self.trainer.cfg.trainer.fault_tolerance
        deadline = time.monotonic() + ft.quorum_timeout_s
        while True:
            step = int(self.store.get(SYNCED_KEY))
            state, source, exact = self._receive(step)
            if state is not None:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"local-SGD worker {self.worker}: no worker sent its state of step {step} within "
                    f"{ft.quorum_timeout_s:g} s"
                )
            time.sleep(POLL_S)
        self.member.load_state(state)
        self.own.send_checkpoint([], step, state, self.timeout)  # for a neighbour restored at the same sync
        self.manager.load_state_dict({"step": int(state["manager_step"]), "batches_committed": 0})
        self.restored_from = step
        if not exact:
            self.inexact.append(f"restored at step {step} with worker {source}'s inner optimizer state")
            log.warning("local-SGD worker %d: %s (its own copy is gone)", self.worker, self.inexact[-1])
        if self.rank == 0:
            log.info("local-SGD worker %d: took step %d's state from worker %d; replaying", self.worker, step, source)

    def _receive(self, step: int) -> tuple[dict | None, int, bool]:
        """(state, its worker, whether it is this worker's own): the successor's copy if it holds step ``step``'s,
        else the first other worker's own state at that sync that arrives."""
        successor, gone = (self.worker + 1) % self.workers, self._given_up()
        sources = [(w % self.workers, "own") for w in range(self.worker + 1, self.worker + self.workers)]
        copy = backup_key(self.worker)
        if self.store.check([copy]) and self.store.get(copy).decode() == str(step):
            sources.insert(0, (successor, "held"))
        for worker, kind in sources:
            if worker in gone:
                continue
            try:
                address = self.store.get(address_key(kind, worker, self.rank)).decode()
                return self.held.recv_checkpoint(worker, address, step, self.timeout), worker, kind == "held"
            except TRANSFER_ERRORS as error:
                log.warning("local-SGD worker %d: worker %d sent no state (%s)", self.worker, worker, error)
        return None, -1, False

    def record(self) -> dict:
        return {
            "restored_from": self.restored_from,
            "inexact": self.inexact,
            "waited_at_syncs_s": round(self.waited_s, 3),
            "failed_syncs": self.failed_syncs,
        }

    def close(self) -> None:
        self.own.shutdown()
        self.held.shutdown()
