"""Fabric's DDP strategy for the ranks train.py starts on this machine, by ``trainer.start_method``.

``spawn``: Fabric's own launcher, fresh interpreters. ``forkserver`` (the default): Fabric's launcher
with two additions. The fork server preloads torch, Fabric and this package (launch/rank_preload.py), so a
rank costs a fork instead of ~3-4 s of imports. And every rank gets this process's environment as it is
at launch: a fork server's children inherit the server's environment, which is as old as the server
(a Hydra sweep's first job, a test session's first launch), while the variables a job sets -- its id,
its producer's key, Fabric's port -- change from job to job.

Module-level classes: the launcher is pickled to the ranks with its bound method.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable
from typing import Any

from lightning_fabric.strategies import DDPStrategy
from lightning_fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher

PRELOAD = f"{__package__}.rank_preload"  # what the fork server of trainer.start_method=forkserver imports


class EnvironmentForwardingLauncher(_MultiProcessingLauncher):
    """Fabric's multiprocessing launcher on a fork server, forwarding the launch-time environment."""

    environ: dict[str, str]

    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        multiprocessing.set_forkserver_preload([PRELOAD])  # read once, when the server starts
        # the port Fabric's launcher exports next: the ranks' copy of the environment must hold it
        os.environ["MASTER_PORT"] = str(self._strategy.cluster_environment.main_port)
        self.environ = dict(os.environ)
        return super().launch(function, *args, **kwargs)

    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server ignores it (launch/rank_preload.py)
        os.environ.clear()
        os.environ.update(self.environ)
        super()._wrapping_function(process_idx, *args, **kwargs)


class ForkserverDDPStrategy(DDPStrategy):
    def _configure_launcher(self) -> None:
        self._launcher = EnvironmentForwardingLauncher(self, start_method="forkserver")


def ddp_strategy(start_method: str, **kwargs: Any) -> DDPStrategy:
    if start_method == "forkserver":
        return ForkserverDDPStrategy(start_method="forkserver", **kwargs)
    return DDPStrategy(start_method=start_method, **kwargs)
