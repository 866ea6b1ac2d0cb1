"""One training process: its logging, threads and device settings, Fabric over the process group,
the job's producer shared from rank 0, then the training loop (train/loop.py). launch/entry.py starts these
processes (or, under torchrun/srun, is one of them)."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

from ..base.launch_env import LaunchError, cluster_environment, detect
from ..base.net import is_loopback, outward_address, split_address
from ..base.processes import end_helpers
from ..config import Config, cpu_count, determinism
from ..validation import world_size

log = logging.getLogger("disttrain")
SUMMARY_FILE = "summary.json"


def fabric_worker(fabric, run, run_dir: str) -> None:
    run_worker(run, run_dir, fabric)


def elastic_worker(run, run_dir: str) -> None:
    run_worker(run, run_dir)


def _setup_worker_logging(rank: int, run_dir: str) -> None:
    root = logging.getLogger()
    if any(getattr(h, "_disttrain", False) for h in root.handlers):
        return
    if root.handlers and rank == 0:
        return  # the Hydra job process already logs to console and train.log
    formatter = logging.Formatter(f"[%(asctime)s][rank {rank}][%(name)s][%(levelname)s] - %(message)s")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if rank == 0:
        handlers.append(logging.FileHandler(Path(run_dir) / "train.log"))
    for handler in handlers:
        handler.setFormatter(formatter)
        handler._disttrain = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def configure_threads(cfg: Config) -> int:
    import torch

    threads = cfg.trainer.threads_per_rank or max(1, cpu_count() // cfg.trainer.devices)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return threads


def cuda_environment(cfg: Config, accelerator: str) -> dict[str, str]:
    """Variables the CUDA runtime reads when a process creates its context: set in the launcher before it
    starts the ranks (Fabric's spawn launcher creates each rank's context before ``run_worker`` runs), and
    again in ``configure_device`` for ranks torchrun or srun start."""
    out = {}
    if accelerator != "cuda":
        return out
    if determinism(cfg.trainer.deterministic, accelerator):
        out["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if cfg.parallel.comm.tp_overlap:
        # The chunked TP overlap relies on kernels running in the order they are queued across the compute
        # and communication streams (Megatron's requirement for sequence-parallel overlap).
        out["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return out


def configure_device(cfg: Config, accelerator: str) -> None:
    """Determinism, TF32 and CUDA launch settings; before the first CUDA call of this process."""
    import torch

    for name, value in cuda_environment(cfg, accelerator).items():
        if accelerator == "cuda" and torch.cuda.is_initialized() and os.environ.get(name) != value:
            log.warning("%s=%s is set after this process's CUDA context exists: it has no effect here", name, value)
        os.environ.setdefault(name, value)
    strict = determinism(cfg.trainer.deterministic, accelerator)
    if strict:
        torch.use_deterministic_algorithms(True, warn_only=strict == "warn")
    if accelerator != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = cfg.trainer.tf32
    torch.backends.cudnn.allow_tf32 = cfg.trainer.tf32


def run_worker(run, run_dir: str, fabric=None) -> dict[str, Any]:
    """One training process: Fabric setup (unless Fabric's launcher already did), then the training loop.
    ``run``: the launcher's ``ResolvedRun`` (parallel/resolved.py); nothing here resolves it again."""
    from ..comm import flight
    from ..train.loop import Trainer
    from ..train.stop import StopRequest

    container = run.container
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) and container["trainer"]["resume"] == "none":
        # a relaunch by an elastic agent (trainer.max_restarts, torchrun --max-restarts) continues from the
        # latest complete checkpoint of this run, not from step 0 over it
        run = run.with_container({**container, "trainer": {**container["trainer"], "resume": "auto"}})
    cfg = run.cfg
    trainer = cfg.trainer
    job_dir = run_dir
    if trainer.fault_tolerance.enabled:  # a replica group (launch/replica_groups.py): its logs apart, checkpoints not
        from ..train.fault_tolerance.replica import replica_index

        run_dir = str(Path(job_dir) / "replicas" / f"r{replica_index()}")
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    environment = detect()
    if environment.kind == "spawned" and fabric is not None:
        rank = int(os.environ.get("NODE_RANK", 0)) * trainer.devices + int(os.environ.get("LOCAL_RANK", 0))
    else:
        rank = environment.rank
    # Signals from here on are a request to stop at an agreed step with a checkpoint (train/stop.py)
    stop_request = StopRequest(float(trainer.stop_grace_s), on_signal=flight.dump)
    _setup_worker_logging(rank, run_dir)
    flight.configure(run_dir, rank)
    # `kill -USR1 <pid>` prints every thread's Python stack, even while the main thread waits inside a collective
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    configure_threads(cfg)
    accelerator = run.accelerator
    configure_device(cfg, accelerator)
    if fabric is None:
        fabric = _attach_fabric(run, environment)
    fabric.seed_everything(trainer.seed, verbose=False)
    pool = None
    try:
        if cfg.data.producer.workers > 0 and cfg.data.producer.address is None:
            pool, container = share_producer(cfg, run.container, fabric)
            run = run.with_container(container)
            cfg = run.cfg
        metrics = Trainer(run, fabric, run_dir, stop_request, job_dir=job_dir).fit()
    except BaseException as error:
        flight.dump(f"exception: {type(error).__name__}: {error}")
        end_helpers()  # the decode workers: they ignore the SIGTERM multiprocessing ends them with at exit
        raise
    finally:
        if pool is not None:
            pool.stop()
    if trainer.memory_report_step:  # the planner's prediction for this rank's role, beside what it counted
        from ..planner.api import annotate_memory_report

        annotate_memory_report(cfg, run.layout, Path(run_dir), fabric.global_rank)
    if fabric.global_rank == 0:
        partial = Path(run_dir) / f"{SUMMARY_FILE}.partial"  # replaced whole: a reader never sees half of it
        partial.write_text(json.dumps(metrics, indent=1, sort_keys=True))
        partial.replace(Path(run_dir) / SUMMARY_FILE)
    return metrics


def _attach_fabric(run, environment):
    """Fabric over processes someone else created (torchrun, srun, the elastic agent, or just this one)."""
    from datetime import timedelta

    from lightning_fabric import Fabric
    from lightning_fabric.strategies import DDPStrategy

    trainer = run.cfg.trainer
    strategy: Any = "auto"
    if world_size(run.cfg) > 1:
        _init_elastic_attempt(run.backend, timedelta(seconds=trainer.dist_timeout_s))
        strategy = DDPStrategy(
            process_group_backend=run.backend,
            timeout=timedelta(seconds=trainer.dist_timeout_s),
            cluster_environment=cluster_environment(environment),
        )
    precision = run.precision
    # The launcher chose this process's environment (base/launch_env.py); Lightning's auto-detection would otherwise
    # warn on every run of a machine that merely has srun installed (a SLURM login node, this repo's test machine)
    warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")
    fabric = Fabric(
        accelerator=run.accelerator,
        devices=trainer.devices,
        num_nodes=trainer.num_nodes,
        strategy=strategy,
        precision="32-true" if precision == "32" else precision,
    )
    fabric.launch()
    return fabric


def _init_elastic_attempt(backend: str, timeout) -> None:
    """Under torch's elastic agent (torchrun, or trainer.max_restarts) the ranks of every attempt meet in the
    agent's one store; gloo's rendezvous keys of a dead attempt are still there, and a relaunched rank can
    read them and dial the old ranks' ports. The process group is made here on a prefix of its own per
    attempt (Fabric then finds it initialized)."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return
    # Restart counts agree between ranks only when one agent started them all (train.py's, or a one-node
    # torchrun): several nodes' agents count membership changes differently, and would use different prefixes.
    if os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE"):
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"disttrain/attempt_{attempt}/", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


def share_producer(cfg: Config, container: dict, fabric):
    """Rank 0 starts the job's producers (data.producer.count); every rank learns their addresses and the key
    from rank 0 (raw bytes over a host-side group, never pickled)."""
    import torch
    import torch.distributed as dist

    from ..data.producer import LocalPool
    from ..data.transport import new_key

    pool, text = None, b""
    if fabric.global_rank == 0:
        key = cfg.data.producer.key or new_key()
        listen = cfg.data.producer.listen
        pool = LocalPool(cfg, container, key)
        advertised = []
        for address in pool.addresses:
            host, port = split_address(address)
            if host in ("0.0.0.0", "::"):  # the address other nodes reach this one by: toward rank 0's peers
                host = outward_address(os.environ.get("MASTER_ADDR", "127.0.0.1"))
            if cfg.trainer.num_nodes > 1 and is_loopback(host):
                raise LaunchError(
                    f"the data producer would be advertised as {host}, which other nodes cannot reach; set "
                    "data.producer.listen=<this node's address>:0"
                )
            advertised.append(f"{host}:{port}")
        text = f"{','.join(advertised)} {key}".encode()
        log.info(
            "%d data producer(s) with %d decode worker(s) each on %s (listening on %s)",
            len(pool.addresses),
            cfg.data.producer.workers,
            ",".join(advertised),
            listen,
        )
    group = dist.new_group(backend="gloo")
    size = torch.tensor([len(text)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8)
    if fabric.global_rank == 0:
        buffer.copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))
    dist.broadcast(buffer, src=0, group=group)
    dist.destroy_process_group(group)
    address, key = bytes(buffer.tolist()).decode().split(" ", 1)
    os.environ["DISTTRAIN_PRODUCER_KEY"] = key
    producer_cfg = {**container["data"]["producer"], "address": address}
    return pool, {**container, "data": {**container["data"], "producer": producer_cfg}}
