"""Process lifetime: no helper process outlives the process that started it.

A training rank's decode workers, the data producer and its workers are started with
``die_with_parent``: Linux delivers a signal to them the moment their parent dies, however
it dies (``kill -9`` included). Without it a killed rank leaves its decode workers (hundreds
of MB each) and multiprocessing's resource tracker running after the job has ended.
Interrupts are left to the trainers: a helper ignores SIGINT and SIGTERM (Ctrl-C signals a
terminal's whole process group, SLURM's preemption notice every process of the job step), so
the ranks stop at an agreed step and checkpoint (train/stop.py) with their helpers still
working. The producer stops on SIGUSR2, which is also its parent-death signal.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux only). Precisely: when
    the parent's thread that started this process exits -- start helpers from a long-lived thread, or
    use ``watch_parent``. ``parent``: the pid the parent had when it started this process (read there,
    not here, so a parent that died before this call is noticed: this process then exits at once).

    Returns False where the platform has no such facility.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:
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


def helper_process_init(parent: int, nice: int = 0) -> None:
    """Start of a decode worker: killed with its parent, deaf to Ctrl-C and to SIGTERM. A scheduler
    (SLURM) sends SIGTERM to every process of a job step; the rank then stops at an agreed step and
    still needs its decode workers for that step."""
    die_with_parent(parent, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if nice:
        os.nice(nice)


def end_helpers() -> int:
    """SIGKILL this process's daemonic multiprocessing children (its decode workers); returns how many.

    For a process leaving on an error. At exit, multiprocessing sends its daemonic children SIGTERM and
    then waits for each: helpers ignore SIGTERM (``helper_process_init``), so an error raised while decode
    workers run would hold the rank's exit until its stop timer or the launcher killed it (20-600 s,
    trainer.stop_grace_s), and the rank that raised, never signalled, would wait for ever."""
    import multiprocessing

    with contextlib.suppress(ValueError):  # not the main thread: no handler of its own to put back
        # torch's DataLoader raises from its SIGCHLD handler when a worker is killed: here that is the point
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    ended = 0
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(timeout=5)
            ended += 1
    return ended
