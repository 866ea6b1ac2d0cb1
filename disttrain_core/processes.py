"""Process lifetime: no helper process outlives the process that started it.

A training rank's decode workers, the data producer and its workers are started with
``die_with_parent``: Linux delivers a signal to them the moment their parent dies, however
it dies (``kill -9`` included). Without it a killed rank leaves its decode workers (hundreds
of MB each) and multiprocessing's resource tracker running after the job has ended.
Terminal interrupts are left to the trainers: a helper ignores SIGINT, so Ctrl-C reaches
the ranks, which stop at an agreed step and checkpoint (train/stop.py), instead of killing
their decode workers under them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux only).

    Returns False where the platform has no such facility. If the parent is already gone
    (a race between fork and this call), exits at once.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent or parent == 1:
        os._exit(1)
    return True


def helper_process_init(nice: int = 0) -> None:
    """Start of a helper process (decode worker, producer): tied to its parent, deaf to Ctrl-C."""
    die_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if nice:
        os.nice(nice)
