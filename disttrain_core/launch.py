"""From a composed config to running processes.

``launch`` runs in the Hydra job process: it validates the config, prepares
the data, writes the resolved config into the run directory, then starts the
training processes. Ranks are started here, not by Fabric's launcher, because
Fabric's launcher re-executes ``sys.argv`` -- which under ``-m`` would make
every child run the whole sweep again. Each child gets ``LOCAL_RANK``,
``NODE_RANK`` and the rendezvous address in its environment, so Fabric sees an
externally created process and only initializes the process group. Under
torchrun or SLURM (processes already created) no spawning happens.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .config import Config, cpu_count, determinism, training_precision, typed_config
from .train.preflight import STATE_ERRORS, check_state_sources
from .validation import (
    ConfigError,
    externally_launched,
    resolve_accelerator,
    resolve_backend,
    validate_config,
    world_size,
)

log = logging.getLogger("disttrain")

SUMMARY_FILE = "summary.json"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare_data(cfg: Config) -> None:
    from .data.reader import resolve_shards
    from .data.synthetic import generate_shards

    if resolve_shards(cfg.data.path) or not cfg.data.generate_if_missing:
        return
    log.info(
        "no shards in %s: generating the embedded synthetic data (%d shards x %d samples)",
        cfg.data.path,
        cfg.data.synthetic.num_shards,
        cfg.data.synthetic.samples_per_shard,
    )
    generate_shards(cfg.data.synthetic, cfg.data.path)


def with_device_defaults(container: dict) -> dict:
    """``auto`` precision and determinism made concrete for this run's accelerator (recorded in the run's
    config.yaml): bf16-mixed and non-deterministic kernels on CUDA, fp32 and deterministic on CPU."""
    trainer = dict(container["trainer"])
    device = resolve_accelerator(trainer["accelerator"])
    trainer["precision"] = training_precision(trainer["precision"], device)
    trainer["deterministic"] = determinism(trainer["deterministic"], device)
    return {**container, "trainer": trainer}


def launch(cfg: DictConfig) -> float | None:
    """Validate, prepare and run one training job; returns the optimized metric."""
    container = OmegaConf.to_container(cfg, resolve=True)
    cfg = typed_config(container)
    try:
        validate_config(cfg)
        container = with_device_defaults(container)
        cfg = typed_config(container)
        if cfg.parallel.mode == "auto":
            from .planner.auto import resolve_auto

            container = resolve_auto(cfg, container, Path(cfg.paths.output_dir))
            if container is None:  # dry run: the plan was printed and saved
                return None
            cfg = typed_config(container)
            validate_config(cfg)
        check_state_sources(cfg, Path(cfg.paths.output_dir))
    except (ConfigError, *STATE_ERRORS) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    run_dir = Path(cfg.paths.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    if cfg.trainer.dry_run:
        from .models.info import model_table
        from .planner.rehearsal import rehearse

        print(model_table(cfg.model))
        print(f"world size {world_size(cfg)}: {cfg.trainer.devices} process(es) x {cfg.trainer.num_nodes} node(s)")
        print("rehearsal: each rank role built on the meta device, model state planned vs counted")
        rehearse(cfg, run_dir)
        return None
    prepare_data(cfg)
    producer = None
    if cfg.data.producer.workers > 0 and cfg.data.producer.address is None:
        # Disaggregated preprocessing on this host: a producer process on 127.0.0.1 with a fresh key
        # that only this job's processes know (environment, never the saved config).
        from .data.producer import start_local_producer
        from .data.transport import new_key

        key = new_key()
        os.environ["DISTTRAIN_PRODUCER_KEY"] = key
        producer, address = start_local_producer(cfg, container, key)
        log.info("data producer with %d decode worker(s) on %s", cfg.data.producer.workers, address)
        container = {**container, "data": {**container["data"], "producer": {**container["data"]["producer"]}}}
        container["data"]["producer"]["address"] = address
        cfg = typed_config(container)
    try:
        if externally_launched() or world_size(cfg) == 1:
            run_worker(container, str(run_dir))
        else:
            spawn_local_processes(cfg, container, str(run_dir))
    finally:
        if producer is not None:
            producer.terminate()
            producer.join(timeout=10)
    summary = run_dir / SUMMARY_FILE
    if summary.is_file():
        return json.loads(summary.read_text()).get(cfg.optimized_metric)
    return None


def spawn_local_processes(cfg: Config, container: dict, run_dir: str) -> None:
    import torch.multiprocessing as mp

    env = {
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": os.environ.get("MASTER_PORT", str(_free_port())),
        "NODE_RANK": os.environ.get("NODE_RANK", "0"),
        "WORLD_SIZE": str(world_size(cfg)),
    }
    log.info("starting %d process(es) on node %s of %d", cfg.trainer.devices, env["NODE_RANK"], cfg.trainer.num_nodes)
    mp.start_processes(
        _spawned_worker, args=(container, run_dir, env), nprocs=cfg.trainer.devices, join=True, start_method="spawn"
    )


def _spawned_worker(local_rank: int, container: dict, run_dir: str, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ["LOCAL_RANK"] = str(local_rank)
    run_worker(container, run_dir)


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


def configure_device(cfg: Config, accelerator: str) -> None:
    """Determinism, TF32 and CUDA launch settings; before the first CUDA call of this process."""
    import torch

    strict = determinism(cfg.trainer.deterministic, accelerator)
    if strict:
        if accelerator == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=strict == "warn")
    if accelerator != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = cfg.trainer.tf32
    torch.backends.cudnn.allow_tf32 = cfg.trainer.tf32
    if cfg.parallel.comm.tp_overlap:
        # The chunked TP overlap relies on kernels running in the order they are queued across the compute
        # and communication streams (Megatron's requirement for sequence-parallel overlap).
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def run_worker(container: dict, run_dir: str) -> dict[str, Any]:
    """One training process: Fabric setup, then the training loop."""
    from datetime import timedelta

    from lightning_fabric import Fabric
    from lightning_fabric.strategies import DDPStrategy

    from .train.loop import Trainer

    cfg = typed_config(container)
    trainer = cfg.trainer
    rank = int(os.environ.get("NODE_RANK", 0)) * trainer.devices + int(os.environ.get("LOCAL_RANK", 0))
    _setup_worker_logging(rank, run_dir)
    configure_threads(cfg)
    accelerator = resolve_accelerator(trainer.accelerator)
    configure_device(cfg, accelerator)
    backend = resolve_backend(trainer.backend, accelerator)
    strategy: Any = "auto"
    if world_size(cfg) > 1:
        strategy = DDPStrategy(process_group_backend=backend, timeout=timedelta(seconds=trainer.dist_timeout_s))
    precision = training_precision(trainer.precision, accelerator)
    fabric = Fabric(
        accelerator=accelerator,
        devices=trainer.devices,
        num_nodes=trainer.num_nodes,
        strategy=strategy,
        precision="32-true" if precision == "32" else precision,
    )
    fabric.launch()
    fabric.seed_everything(trainer.seed, verbose=False)
    metrics = Trainer(cfg, fabric, run_dir).fit()
    if trainer.memory_report_step:  # the planner's prediction for this rank's role, beside what it counted
        from .planner.breakdown import annotate_memory_report

        annotate_memory_report(cfg, Path(run_dir), fabric.global_rank)
    if fabric.global_rank == 0:
        (Path(run_dir) / SUMMARY_FILE).write_text(json.dumps(metrics, indent=1, sort_keys=True))
    return metrics
