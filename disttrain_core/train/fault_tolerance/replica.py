"""One replica group's part in a fault-tolerant job (``trainer.fault_tolerance``; docs/FAULT_TOLERANCE.md).

The job is ``replicas`` independent groups of processes; the launcher (launch/replica_groups.py) starts each
with its own process group and restarts one that dies, and never touches the others. Inside a group the run is
an ordinary data-parallel run (DDP over the group's processes). Across groups, torchft's ``Manager`` keeps a
quorum each step through its Lighthouse, reduces gradients over the groups in it, and decides whether the step
commits. Every step:

1. ``begin_step``: the quorum (synchronous). A group that is behind -- a replacement -- receives the model, the
   optimizer, the step and the data position from a healthy peer here (train/fault_tolerance/transport.py),
   not from disk, and continues from them.
2. ``share``: the step's global batch is fixed (every group reads the whole step, global stream); its
   microbatches are split among the groups of the quorum (participant ``p`` of ``P`` takes microbatches
   ``[p*A//P, (p+1)*A//P)`` of the step's ``A``: gradient accumulation where a group takes more), and the loss is
   normalized by the whole batch's counts, as without faults. No sample is lost or repeated.
3. ``reduce``: gradients and the logged loss sums summed over the quorum (torchft's fault-tolerant all-reduce).
4. ``commit``: torchft's vote. A step some group failed in (a peer died mid all-reduce) commits nowhere; every
   group discards its gradients, rewinds its data position and takes the step again with the new quorum.

So with fp32 and the same seed, a run with failures ends where a run without them ends (tests/faults/
test_fault_tolerance.py holds it at 1e-5).
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta

import torch

from ...base.dtensor import local
from ...base.faults import inject
from ...base.net import split_address
from ...config.fault_tolerance import quorum_minimum
from .workers import worker_share

log = logging.getLogger(__name__)

# What the launcher tells each process of a group (launch/replica_groups.py)
REPLICA_ENV = "DISTTRAIN_FT_REPLICA"  # the group's index, 0..replicas-1
START_ENV = "DISTTRAIN_FT_START"  # 0 for the first start of that group, 1 for its first replacement, ...
STORE_ENV = "DISTTRAIN_FT_STORE"  # host:port of the group's store (the launcher serves it)
LIGHTHOUSE_ENV = "DISTTRAIN_FT_LIGHTHOUSE"  # http://host:port of the job's Lighthouse
KEY_ENV = "DISTTRAIN_FT_KEY"  # the job's key for live recovery (data/transport.py load_key)


def in_replica_group() -> bool:
    return REPLICA_ENV in os.environ


def replica_index() -> int:
    return int(os.environ[REPLICA_ENV])


def start_count() -> int:
    return int(os.environ.get(START_ENV, "0"))


def _without_traceback(record: logging.LogRecord) -> bool:
    record.exc_info = record.exc_text = None
    return True


@contextlib.contextmanager
def manager_server_bound_to(host: str):
    """torchft 0.2.0's Manager binds its server to every interface (``[::]:port``, fixed in ``Manager.__init__``);
    this binds it to ``host`` instead, for the Manager built inside."""
    import torchft.manager as manager_module

    original = manager_module.ManagerServer
    literal = f"[{host}]" if ":" in host else host

    def bound(*args, bind: str, **kwargs):
        return original(*args, bind=f"{literal}:{bind.rsplit(':', 1)[1]}", **kwargs)

    manager_module.ManagerServer = bound
    try:
        yield
    finally:
        manager_module.ManagerServer = original


class ReplicaGroupMember:
    """This process's part in the quorum (module docstring). ``trainer``: the Trainer (train/loop.py)."""

    def __init__(self, trainer):
        from torchft.manager import Manager

        from ...data.transport import load_key
        from .transport import HealTransport

        self.trainer = trainer
        ft = trainer.cfg.trainer.fault_tolerance
        # torchft logs every quorum and commit at info, and each reconfiguration warns about NCCL's flight
        # recorder on CPU: its errors stay, this module says what a replica group does
        for name, level in (("torchft_quorums", logging.WARNING), ("torchft_commits", logging.WARNING)):
            logging.getLogger(name).setLevel(level)
        manager_log = logging.getLogger("torchft.manager")
        manager_log.setLevel(logging.ERROR)
        manager_log.addFilter(_without_traceback)  # a peer's death is an expected error: its one line is enough
        self.replica = replica_index()
        timeout = timedelta(seconds=ft.timeout_s)
        host, port = split_address(os.environ[STORE_ENV])
        group_rank, group_size = trainer.rank, trainer.world_size
        # the group's own store (the launcher serves it): torchft's Manager keeps its server's address in it
        self.store = torch.distributed.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
        key = load_key(os.environ[KEY_ENV])
        self.transport = HealTransport(key, bind=ft.bind, timeout=ft.timeout_s)
        self.healed_from: list[int] = []  # the steps this group received its state at
        self.uncommitted = 0  # steps taken again because the quorum did not commit them
        self.quorum_sizes: dict[int, int] = {}  # committed step -> the groups that took part in it
        with manager_server_bound_to(ft.bind):
            self.manager = Manager(
                pg=self._process_group(timeout),
                load_state_dict=self.load_state,
                state_dict=self._state,
                min_replica_size=quorum_minimum(ft),
                use_async_quorum=False,  # every group of the quorum takes part in the step it heals at
                timeout=timeout,
                quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
                connect_timeout=timeout,
                rank=group_rank,
                world_size=group_size,
                store_addr=host,
                store_port=port,
                lighthouse_addr=os.environ[LIGHTHOUSE_ENV],
                replica_id=f"replica_{self.replica}",
                hostname=ft.bind,
                checkpoint_transport=self.transport,
                init_sync=False,  # every group builds the same model from the same seed
            )
        # a run resumed from a checkpoint starts at its step; a replacement starts at 0 and is healed
        self.manager.load_state_dict({"step": trainer.step, "batches_committed": 0})
        self._position: dict | None = None
        # parallel.mode=local_sgd: each group is a worker that meets the others at syncs only (workers.py)
        self.workers = None
        if trainer.cfg.parallel.mode == "local_sgd":
            from .workers import WorkerReplicas

            self.workers = trainer.engine.ft_workers = WorkerReplicas(self, key)
            if start_count() > 0:
                self.workers.restore()

    @property
    def per_step(self) -> bool:
        """Whether every step meets the quorum (not local SGD's workers, which meet at syncs)."""
        return self.workers is None

    def _process_group(self, timeout: timedelta):
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        if self.trainer.run.backend == "nccl":
            return ProcessGroupNCCL(timeout=timeout)
        return ProcessGroupGloo(timeout=timeout)

    # ------------------------------------------------------------------ live recovery
    def _state(self) -> dict:
        """What a joining group receives: model and optimizer by name, the step and the data position."""
        trainer = self.trainer
        return {
            "tensors": trainer.engine.checkpoint_state(saving=False),
            "step": trainer.step,
            "data": trainer.loader.state_dict(),
        }

    def load_state(self, state: dict) -> None:
        from ..inputs import build_loader
        from ..optim import restore_scheduler

        trainer = self.trainer
        live = trainer.engine.checkpoint_state(saving=False)
        missing = sorted(set(live) - set(state["tensors"]))
        if missing:
            raise RuntimeError(f"the healthy replica's state lacks {len(missing)} tensor(s), e.g. {missing[0]}")
        with torch.no_grad():
            for name, target in live.items():
                source = state["tensors"][name]
                if hasattr(target, "local_shards"):  # a ShardedTensor: the peer sent its pieces (same layout)
                    for shard, piece in zip(target.local_shards(), source, strict=True):
                        shard.tensor.copy_(piece)
                    continue
                local(target).copy_(source)
        trainer.engine.checkpoint_loaded([])
        trainer.step = int(state["step"])
        restore_scheduler(trainer.scheduler, trainer.step)
        trainer.loader = build_loader(trainer, state["data"])
        self.healed_from.append(trainer.step)
        if trainer.rank == 0:
            log.info("replica group %d: received step %d's state from a healthy replica", self.replica, trainer.step)

    # ------------------------------------------------------------------ a step
    def begin_step(self) -> None:
        """The quorum of this step (a replacement is healed here); the data position to rewind to if it fails."""
        if not self.per_step:
            return
        self.manager.start_quorum()
        self._position = self.trainer.loader.state_dict()

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    def share(self, microbatches: list) -> list:
        """This group's microbatches of the step: a contiguous share, by its place in the quorum (a local-SGD
        worker: by its index, the same share through failures)."""
        if self.workers is not None:
            return worker_share(microbatches, self.replica, self.workers.workers)
        rank, count = self.manager.participating_rank(), self.participants
        if rank is None:  # a synchronous quorum (use_async_quorum=False) has every group that asked take part
            raise RuntimeError("this replica group is not in the step's quorum; its share of the step is undefined")
        return worker_share(microbatches, rank, count)

    def reduce(self, params: list[torch.nn.Parameter], sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sum gradients and the step's loss sums over the quorum's groups (in place); returns the summed sums.
        A sharded (DTensor) gradient is summed as this process's shard, with the same shard of every group."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        pieces = [local(g) for g in grads]
        device = self.trainer.fabric.device
        flat = torch.cat([g.reshape(-1) for g in pieces]) if pieces else torch.zeros(0, device=device)
        names = sorted(sums)
        losses = torch.stack([sums[n].double() for n in names]) if names else None
        # fault drills: killed as its all-reduce across groups begins, before its part is sent, so the peers'
        # all-reduce fails (after the send a small all-reduce can finish before the kill lands: a race)
        inject("allreduce", self.trainer.rank, self.trainer.step + 1)
        work = self.manager.allreduce(flat, reduce_op=torch.distributed.ReduceOp.SUM)
        loss_work = self.manager.allreduce(losses, reduce_op=torch.distributed.ReduceOp.SUM) if names else None
        work.wait()
        if loss_work is not None:
            loss_work.wait()
        offset = 0
        for param, grad, piece in zip(params, grads, pieces, strict=True):
            count = piece.numel()
            piece.copy_(flat[offset : offset + count].view_as(piece))
            offset += count
            if param.grad is None:
                param.grad = grad
        return {n: losses[i] for i, n in enumerate(names)} if names else sums

    def commit(self) -> bool:
        """Whether every group of the quorum finished the step (torchft's vote); if not, the data position is
        rewound so the step is taken again."""
        if self.manager.should_commit():
            self.quorum_sizes[self.trainer.step + 1] = self.participants
            return True
        from ..inputs import build_loader

        self.uncommitted += 1
        self.trainer.loader = build_loader(self.trainer, self._position)
        if self.trainer.rank == 0:
            log.warning(
                "replica group %d: step %d did not commit (a replica failed during it); taking it again",
                self.replica,
                self.trainer.step + 1,
            )
        return False

    def first_in_quorum(self) -> bool:
        """The group that saves a checkpoint: the first of the last quorum (all groups hold the same state)."""
        return self.manager.participating_rank() == 0

    def finish(self, run_dir, models: list[torch.nn.Module]) -> None:
        """After the last step: this group's record (``fault_tolerance.json`` in its directory, from its rank 0):
        its start, pid, step, the steps it was healed at and taken again, the states it sent, its data position
        and a fingerprint of its parameters (sum and sum of squares, fp64: every group's must be equal)."""
        import json
        from pathlib import Path

        shard = getattr(self.trainer.optimizer, "shard_params", None)
        if shard is not None:  # ZeRO-2's parameters regathered for a next step: back to this process's shards
            shard()
        params = [p.detach() for model in models for p in model.parameters()]
        totals = torch.zeros(2, dtype=torch.float64)
        for param in params:
            piece = local(param).double()
            totals += torch.stack([piece.sum(), piece.square().sum()]).cpu()
        record = {
            "replica": self.replica,
            "start": start_count(),
            "pid": os.getpid(),
            "step": self.trainer.step,
            "manager_step": self.manager.current_step(),
            "healed_at": self.healed_from,
            "uncommitted_steps": self.uncommitted,
            "groups_per_step": self.quorum_sizes,  # the steps this group committed, each with its quorum's size
            "states_sent": self.transport.sent,
            "data": self.trainer.loader.state_dict(),
            "parameter_fingerprint": totals.tolist(),
        }
        if self.workers is not None:
            record["local_sgd"] = self.workers.record()
            self.workers.close()
        if self.trainer.rank == 0:
            Path(run_dir, "fault_tolerance.json").write_text(json.dumps(record, indent=1))
        self.manager.shutdown(wait=False)
