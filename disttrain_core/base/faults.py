"""Fault injection for drills and the fault suite (tests/faults/).

``DISTTRAIN_FAULT`` names faults as ``KIND@POINT:rank=R:step=S``, several separated by ``;``:

    DISTTRAIN_FAULT="kill@step:rank=1:step=7"      # SIGKILL rank 1 as step 7 begins
    DISTTRAIN_FAULT="term@step:rank=1:step=4"      # SIGTERM to rank 1 (a preemption notice)
    DISTTRAIN_FAULT="hang@step:rank=1:step=3"      # rank 1 stops before the step's first collective
    DISTTRAIN_FAULT="raise@step:rank=0:step=2"     # an exception in rank 0
    DISTTRAIN_FAULT="kill@save:rank=0:step=4"      # SIGKILL while checkpoint 4 is being written
    DISTTRAIN_FAULT="enospc@save:rank=1:step=4"    # the disk is full while checkpoint 4 is written
    DISTTRAIN_FAULT="kill@produce:rank=1:step=2"   # SIGKILL data producer 1 (of a pool) once it made step 2

Points are ``step`` (start of a training step, before its data and collectives), ``forward``
(a model's forward of the step begins), ``backward`` (the gradient reaches a model's output),
``allreduce`` (a fault-tolerant job's all-reduce across replica groups is under way), ``save``
(after a rank has written part of a checkpoint's files) and ``produce`` (a data producer has
assembled a step; ``rank`` is its place in the pool). ``restart=N`` qualifiers limit a fault to
the Nth run of an elastic job, or the Nth start of a producer or replica group (default 0: the
first), so a relaunched process does not meet the same fault again. In a fault-tolerant job a
trainer's rank here is its job rank (replica group x group size + rank in the group; see
``identify``). Nothing happens unless the variable is set.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

ENV = "DISTTRAIN_FAULT"
KINDS = ("kill", "term", "hang", "raise", "enospc")
POINTS = ("step", "forward", "backward", "allreduce", "save", "produce")
_identity: tuple[int, int] | None = None  # (rank offset, restart) of this process; see identify()


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    point: str
    rank: int
    step: int
    restart: int = 0


def parse(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        try:
            head, *fields = item.split(":")
            kind, point = head.split("@")
            values = dict(field.split("=", 1) for field in fields)
            fault = Fault(kind, point, int(values.pop("rank")), int(values.pop("step")), int(values.pop("restart", 0)))
            if values or kind not in KINDS or point not in POINTS:
                raise ValueError
        except (ValueError, KeyError) as error:
            raise ValueError(
                f"{ENV}={text!r}: cannot read {item!r}; write KIND@POINT:rank=R:step=S with KIND in {KINDS} "
                f"and POINT in {POINTS}"
            ) from error
        faults.append(fault)
    return faults


def _active() -> list[Fault]:
    text = os.environ.get(ENV)
    return parse(text) if text else []


def identify(rank_offset: int, restart: int) -> None:
    """This process's place for the faults of the trainer's points: ``rank_offset`` is added to the rank each
    point passes (a replica group's first job rank), and ``restart`` is its start (a replacement's count)."""
    global _identity
    _identity = (rank_offset, restart)


def planned(points: tuple[str, ...], rank: int) -> bool:
    """Whether any fault is planned at one of ``points`` for this rank (so hooks are installed only then)."""
    if ENV not in os.environ:
        return False
    offset = _identity[0] if _identity is not None else 0
    return any(f.point in points and f.rank == rank + offset for f in _active())


def inject(point: str, rank: int, step: int, restart: int | None = None) -> None:
    """Carry out the faults planned for this point, rank and step (a no-op without DISTTRAIN_FAULT); ``restart``:
    which start of the process this is (default: the elastic agent's restart count, or ``identify``'s)."""
    if ENV not in os.environ:
        return
    if _identity is not None and point != "produce":
        rank += _identity[0]
        restart = _identity[1] if restart is None else restart
    if restart is None:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for fault in _active():
        if (fault.point, fault.rank, fault.step, fault.restart) != (point, rank, step, restart):
            continue
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif fault.kind == "hang":
            while True:  # a rank that never reaches its next collective
                time.sleep(3600)
        elif fault.kind == "raise":
            raise InjectedFault(f"injected failure at {point} {step} on rank {rank}")
        elif fault.kind == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (injected)")


def install_model_hooks(models, rank: int, step_of) -> list:
    """The ``forward`` and ``backward`` points on ``models`` (torch modules), only where a fault is planned there
    for this rank; ``step_of()`` is the step being taken. Returns the hooks' handles."""
    if not planned(("forward", "backward"), rank):
        return []
    import torch
    from torch.utils._pytree import tree_leaves

    def before(_module, _args) -> None:
        inject("forward", rank, step_of())

    def on_gradient(grad):
        inject("backward", rank, step_of())
        return grad

    def after(_module, _args, output) -> None:
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            tensors[0].register_hook(on_gradient)

    return [h for m in models for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
