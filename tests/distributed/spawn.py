"""Worker processes for the tests that start their own process groups (``start_processes``), forked from a
warm server instead of started as fresh interpreters.

``torch.multiprocessing.start_processes(..., start_method="spawn")`` costs each worker 3-4 s of a core
importing torch, DTensor and this package before the test's function runs; the suite starts about sixty
such workers. Here they come from the test process's fork server (multiprocessing's ``forkserver``, the
same server and preload train.py's ranks use: launch/rank_preload.py), which imports all of that once per
test session. The server is a fresh interpreter that never ran a kernel, so its forks are as clean as spawned
ones. Each worker gets the test process's environment as it is when the test starts them (the server's own
is as old as the server) and the default SIGTERM (the server ignores it), then runs ``fn(index, *args)``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import torch.multiprocessing as mp

from disttrain_core.launch.fabric import PRELOAD


def _entry(index: int, environ: dict, fn, *args) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(environ)
    fn(index, *args)


def start_processes(fn, args: tuple = (), nprocs: int = 2, join: bool = True):
    """``torch.multiprocessing.start_processes`` on the warm fork server; same arguments and results."""
    from ..conftest import log_run

    multiprocessing.set_forkserver_preload([PRELOAD])  # read once, when the server starts
    started = time.perf_counter()
    context = mp.start_processes(
        _entry, args=(dict(os.environ), fn, *args), nprocs=nprocs, join=join, start_method="forkserver"
    )
    if join:
        log_run(f"{fn.__module__}.{fn.__name__}", [f"nprocs={nprocs}"], time.perf_counter() - started)
    return context
