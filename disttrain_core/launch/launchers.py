"""Starting the ranks of a job on this machine, and telling the user how they ended.

* ``spawn_with_fabric``: Fabric's multiprocessing launcher (``DDPStrategy(start_method=...)``,
  ``fabric.launch(fn)``): it starts a *function* in ``trainer.devices`` processes and does not
  re-execute ``sys.argv``, so a Hydra multirun keeps working. The children are told their cluster
  environment (Fabric's plain ``LightningEnvironment``), never guess it from inherited ``SLURM_*``.
  ``trainer.start_method=forkserver`` (the default) forks the ranks from a server that has imported
  torch and this package once (launch/rank_preload.py); ``spawn`` starts fresh interpreters.
* ``spawn_with_restarts``: torch's elastic agent (``elastic_launch``, the engine behind torchrun) when
  ``trainer.max_restarts > 0``: when a rank dies it stops the others and relaunches all of them, and
  they resume from the latest complete checkpoint. Its shutdown timeout exceeds ``trainer.stop_grace_s``
  so a stopping rank finishes its checkpoint.

Either way SIGTERM/SIGINT to train.py reach every rank as SIGTERM: the ranks stop at an agreed step,
checkpoint and exit 0 (train/stop.py). A rank that dies is reported in one line naming it and the cause.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

from ..base.launch_env import MARK
from ..base.net import free_port

log = logging.getLogger("disttrain")


class RankFailed(RuntimeError):
    """A rank of the job failed; the message names it and the cause (one line); ``rank``: the job rank, where
    one rank's failure ended the job."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set variables for the processes started inside; restore them after (a multirun's next job)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def forward_stop_signals(exclude: set[int]) -> Iterator[None]:
    """SIGTERM/SIGINT to this process -> SIGTERM to its rank processes (not to ``exclude``: the producer)."""

    def forward(signum: int, frame) -> None:
        name = signal.Signals(signum).name
        log.warning("%s: asking every rank to stop at the next step and checkpoint", name)
        for child in multiprocessing.active_children():
            if child.pid not in exclude:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def warm_up(cfg) -> None:
    """Start the fork server this job's ranks will come from now, so that its imports (3-4 s of a CPU
    core, launch/rank_preload.py) overlap the launcher's own imports, validation and data preparation instead of
    following them: a 2-process 1-step run 12.8 s -> 9.5 s here. Only where train.py would start ranks with it
    (not under torchrun/srun, not for a dry run or restarts, not for one process). Called before the
    config is validated: after a config error the server finishes its imports, finds its launcher gone
    and exits (within seconds)."""
    from ..base.launch_env import detect

    trainer = cfg.trainer
    if trainer.start_method != "forkserver" or trainer.dry_run or trainer.max_restarts > 0:
        return
    if trainer.devices * trainer.num_nodes < 2 or detect().external:
        return
    from multiprocessing import forkserver

    from .fabric import PRELOAD

    multiprocessing.set_forkserver_preload([PRELOAD])
    forkserver.ensure_running()


def spawn_with_fabric(cfg, fabric_kwargs: dict, fn: Callable, args: tuple, job_id: str, exclude: set[int]) -> None:
    from lightning_fabric import Fabric
    from lightning_fabric.plugins.environments import LightningEnvironment
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    from .fabric import ddp_strategy

    strategy = ddp_strategy(
        cfg.trainer.start_method,
        process_group_backend=fabric_kwargs.pop("backend"),
        timeout=timedelta(seconds=cfg.trainer.dist_timeout_s),
        cluster_environment=LightningEnvironment(),
    )
    fabric = Fabric(strategy=strategy, **fabric_kwargs)
    node = int(os.environ.get("NODE_RANK", "0"))
    log.info("starting %d process(es) on node %d of %d", cfg.trainer.devices, node, cfg.trainer.num_nodes)
    try:
        with environment({MARK: "spawn", "DISTTRAIN_JOB_ID": job_id}), forward_stop_signals(exclude):
            fabric.launch(fn, *args)
    except ProcessRaisedException as error:
        rank = node * cfg.trainer.devices + error.error_index
        if os.environ.get("HYDRA_FULL_ERROR") == "1":  # the rank's whole traceback, as Hydra's own errors
            print(str(error), file=sys.stderr)
        raise RankFailed(f"rank {rank} failed: {_last_line(str(error))}", rank) from None
    except ProcessExitedException as error:
        rank = node * cfg.trainer.devices + error.error_index
        cause = _signal_name(error.exit_code) if error.exit_code < 0 else f"exit status {error.exit_code}"
        raise RankFailed(f"rank {rank} died ({cause}); the other ranks were stopped", rank) from None


def spawn_with_restarts(cfg, fn: Callable, args: tuple, run_dir: str, job_id: str) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    trainer = cfg.trainer
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=trainer.devices,
        run_id=f"disttrain-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=trainer.max_restarts,
        monitor_interval=0.5,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(run_dir, "elastic")),
        # after a signal, a stopping rank saves its checkpoint before the agent's SIGKILL (when a rank dies,
        # torch's agent gives the others its own fixed 30 s)
        shutdown_timeout=int(trainer.stop_grace_s) + 30,
    )
    log.info(
        "starting %d process(es) under torch's elastic agent (up to %d restart(s))",
        trainer.devices,
        trainer.max_restarts,
    )
    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    previous = {sig: signal.getsignal(sig) for sig in handled}  # the agent installs its own, for good
    try:
        with environment({MARK: "elastic", "DISTTRAIN_JOB_ID": job_id}):
            elastic_launch(config, fn)(*args)
    except SignalException as error:
        log.warning("%s: every rank was asked to stop and checkpoint", error.sigval.name)
    except ChildFailedError as error:
        failures = []
        for rank, failure in sorted(error.failures.items()):
            cause = _signal_name(failure.exitcode) if failure.exitcode < 0 else f"exit status {failure.exitcode}"
            message = failure.message if isinstance(failure.message, str) else ""
            failures.append(f"rank {rank} ({cause}{': ' + _last_line(message) if message else ''})")
        raise RankFailed(
            f"{'; '.join(failures)} after {trainer.max_restarts} restart(s) (trainer.max_restarts)"
        ) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
