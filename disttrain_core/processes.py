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
import threading
import time

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux only). Precisely: when
    the parent's thread that started this process exits -- start helpers from a long-lived thread, or
    use ``watch_parent``.

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


def watch_parent(parent: int, sig: int = signal.SIGTERM, interval_s: float = 1.0) -> None:
    """Send ``sig`` to this process once ``parent`` is no longer its parent (a polling thread).

    For a helper started from a thread other than the main one: the kernel's parent-death signal
    follows the *thread* that forked, which may end long before its process does."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def helper_process_init(nice: int = 0) -> None:
    """Start of a helper process (decode worker, producer): tied to its parent, deaf to Ctrl-C."""
    die_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if nice:
        os.nice(nice)
