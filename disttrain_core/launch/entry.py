"""From a composed config to running processes.

``launch`` runs in the Hydra job process: it validates the config and the process environment
(base/launch_env.py: local, torchrun, srun), prepares the data, writes the resolved config into the run
directory, then starts the ranks of this node (launch/launchers.py: Fabric's launcher, or torch's
elastic agent when ``trainer.max_restarts`` > 0). Under torchrun or srun every process is already a
rank and runs this function itself (launch/worker.py): nothing is spawned, the run directory is named by the job
(conf/hydra: ``run_stamp``), and rank 0 starts the job's one data producer.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..base.launch_env import LaunchError, detect, elastic_nodes, node_rendezvous
from ..base.launch_env import check as check_launch
from ..base.net import is_loopback, split_address
from ..config import Config, determinism, resolve_accelerator, training_precision, typed_config
from ..planner.fit import validate_run
from ..train.preflight import STATE_ERRORS, check_state_sources
from ..validation import ConfigError, world_size
from .launchers import RankFailed, spawn_with_fabric, spawn_with_restarts
from .launchers import environment as scoped_environment
from .worker import SUMMARY_FILE, cuda_environment, elastic_worker, fabric_worker, run_worker

log = logging.getLogger("disttrain")


def prepare_data(cfg: Config) -> None:
    from ..data.storage import is_url

    if cfg.data.format in ("tokens", "hf") or cfg.data.packing.enabled or is_url(str(cfg.data.path)):
        return  # nothing to generate: a URL's shards are there (validation checked) or the run is refused
    if not cfg.data.generate_if_missing:
        return
    _generate_once(str(cfg.data.path), cfg, held_out=False)
    val = cfg.data.val.path
    used = cfg.trainer.val_every_n_steps > 0 or cfg.trainer.eval_only
    if used and val and not is_url(str(val)):  # its held-out split, when validation reads it
        _generate_once(str(val), cfg, held_out=True)


def _generate_once(path: str, cfg: Config, held_out: bool) -> None:
    """The embedded synthetic data (or its held-out split) at ``path`` unless shards are there."""
    import fcntl

    from ..data.reader import resolve_shards
    from ..data.synthetic import generate_shards

    if resolve_shards(path):
        return
    # Under torchrun or srun every rank gets here: one generates, the others wait and find the shards.
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(str(Path(path)) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if resolve_shards(path):
            return
        synthetic = cfg.data.synthetic
        log.info(
            "no shards in %s: generating the embedded synthetic data%s (%d shards x %d samples)",
            path,
            "'s held-out split" if held_out else "",
            synthetic.val_shards if held_out else synthetic.num_shards,
            synthetic.samples_per_shard,
        )
        generate_shards(synthetic, path, held_out=held_out)


def with_device_defaults(container: dict) -> dict:
    """``auto`` precision and determinism made concrete for this run's accelerator (recorded in the run's
    config.yaml): bf16-mixed and non-deterministic kernels on CUDA, fp32 and deterministic on CPU."""
    trainer = dict(container["trainer"])
    device = resolve_accelerator(trainer["accelerator"])
    trainer["precision"] = training_precision(trainer["precision"], device)
    trainer["deterministic"] = determinism(trainer["deterministic"], device)
    return {**container, "trainer": trainer}


def prepare_device(cfg: Config, rank: int) -> None:
    """On CUDA, before this process or any rank it starts creates a CUDA context: the variables the runtime
    reads then (ranks inherit them), and one line when MFU has no datasheet peak for this GPU. On a CPU, one line
    when bf16-mixed has no native kernels there (train/perf.py ``cpu_bf16_line``)."""
    accelerator = resolve_accelerator(cfg.trainer.accelerator)
    for name, value in cuda_environment(cfg, accelerator).items():
        os.environ.setdefault(name, value)
    import torch

    if accelerator == "cpu" and rank == 0 and not cfg.trainer.dry_run:  # a dry run of a GPU plan trains nothing here
        from ..train.perf import cpu_bf16_line

        line = cpu_bf16_line(cfg.trainer.precision)
        if line:
            log.warning(line)
    if accelerator != "cuda" or rank != 0 or not torch.cuda.is_available():  # a dry run plans GPUs it lacks
        return
    from ..train.perf import peak_source, step_math

    math = step_math(cfg.trainer.precision, "cuda", cfg.trainer.tf32)
    line = peak_source(math, torch.cuda.get_device_name(0), cfg.cluster)
    if line:
        log.warning(line)


def elastic_round(container: dict, environment) -> dict:
    """Under elastic torchrun (trainer.min_nodes), the job as this rendezvous round has it: its node count.
    The layout, batch split and data streams follow; the checkpoint reshards into them at resume."""
    trainer = container["trainer"]
    if trainer.get("dry_run"):  # a dry run plans the whole job, wherever it runs
        return container
    nodes = elastic_nodes(environment, trainer["num_nodes"], trainer.get("min_nodes"))
    if nodes == trainer["num_nodes"]:
        return container
    if environment.rank == 0:
        log.warning(
            "elastic round: %d of trainer.num_nodes=%d node(s) joined (torchrun --nnodes=%d:%d); training on %d",
            nodes,
            trainer["num_nodes"],
            trainer["min_nodes"],
            trainer["num_nodes"],
            nodes,
        )
    return {**container, "trainer": {**trainer, "num_nodes": nodes}}


def resolve(cfg: Config, container: dict, environment):
    """Validate, plan where the planner chooses, and resolve the run -- once (parallel/resolved.py); raises the
    one-line errors of ``launch``. Returns None after a dry run of ``parallel=auto`` (the plan was printed)."""
    check_launch(environment, cfg.trainer.devices, cfg.trainer.num_nodes, cfg.trainer.max_restarts)
    check_producer_reach(cfg)
    if cfg.trainer.replan_on_failure and environment.external:
        raise LaunchError(
            "trainer.replan_on_failure: train.py restarts the job on the devices that remain; run it directly (not "
            "under torchrun or srun, whose restarts keep the same ranks)"
        )
    if cfg.trainer.fault_tolerance.enabled and environment.external:
        raise LaunchError(
            "trainer.fault_tolerance: train.py starts the replica groups itself; run it directly (not under "
            "torchrun or srun)"
        )
    container = with_device_defaults(container)
    cfg = typed_config(container)
    run = validate_run(cfg, container)  # None: the planner chooses the layout first
    if run is not None and run.cfg.schedule.name != cfg.schedule.name and environment.rank == 0:
        from ..schedule.generators import SCHEDULES

        stages = sum(unit.pp for unit in run.layout.units)
        log.info(
            "schedule=%s: the layout has %d pipeline stages and names no schedule (another: schedule=<%s>)",
            run.cfg.schedule.name,
            stages,
            "|".join(SCHEDULES),
        )
    prepare_device(cfg, environment.rank)
    if cfg.parallel.mode == "auto":
        from ..planner.auto import resolve_auto

        container = resolve_auto(cfg, container, Path(cfg.paths.output_dir))
        if container is None:  # dry run: the plan was printed and saved
            return None
        run = validate_run(typed_config(container), container, plan=container["parallel"])
    elif run is None:  # HotSPa's strategies=[auto]
        from ..planner.hotspa_auto import resolve_hotspa_auto

        container = resolve_hotspa_auto(cfg, container, Path(cfg.paths.output_dir))
        run = validate_run(typed_config(container), container, plan=container["parallel"])
    if run.cfg.parallel.pp_split == "auto":
        run = _resolve_pp_split(run, container)
    if run.cfg.parallel.cp_mode == "auto":
        run = _resolve_cp_mode(run, container, environment.rank)
    if run.cfg.trainer.fault_tolerance.enabled and run.cfg.trainer.fault_tolerance.lighthouse:
        from .replica_groups import lighthouse_reachable

        lighthouse_reachable(run.cfg.trainer.fault_tolerance.lighthouse)
    check_state_sources(run.cfg, Path(run.cfg.paths.output_dir))
    return run


def _resolved_again(container: dict, run, environment):
    """trainer.replan_on_failure: the composed config planned for fewer devices, with the running job's data
    producer (one train.py started keeps serving)."""
    container["data"]["producer"] = run.container["data"]["producer"]
    return resolve(typed_config(container), container, environment)


def _resolve_pp_split(run, container: dict):
    """parallel.pp_split=auto on a configured layout: the planner's balanced split, printed, then validated as if
    typed (parallel=auto plans write theirs into the layout they return)."""
    from ..planner.api import auto_pp_split

    split, seconds = auto_pp_split(run.cfg, run.layout)
    slowest = max(seconds)
    times = ", ".join(f"{s / slowest:.2f}" for s in seconds)
    line = f"parallel.pp_split=auto: LLM blocks per stage {split} (predicted stage times, slowest = 1: {times})"
    print(line, flush=True)
    container["parallel"]["pp_split"] = split
    return validate_run(typed_config(container), container)


def _resolve_cp_mode(run, container: dict, rank: int):
    """parallel.cp_mode=auto: the planner's choice for the configured LLM (planner/auto.py ``auto_cp_mode``),
    printed with each mode's predicted seconds, then validated as if typed. Without context parallelism: ring."""
    if not any(unit.cp > 1 for unit in run.layout.units):
        container["parallel"]["cp_mode"] = "ring"
        return validate_run(typed_config(container), container)
    from ..planner.auto import auto_cp_mode

    mode, ulysses, found = auto_cp_mode(run.cfg, run.layout)
    if rank == 0:
        times = ", ".join(
            f"{label} {seconds * 1e3:.3g} ms / {peak / 1e9:.3g} GB" for label, (seconds, peak) in found.items()
        )
        print(
            f"parallel.cp_mode=auto: {mode} (predicted LLM rank time per microbatch / peak memory: {times})", flush=True
        )
    container["parallel"]["cp_mode"] = mode
    container["parallel"]["cp_ulysses"] = ulysses if mode == "hybrid" else 0
    return validate_run(typed_config(container), container)


def launch(cfg: DictConfig) -> float | None:
    """Validate, prepare and run one training job; returns the optimized metric."""
    container = OmegaConf.to_container(cfg, resolve=True)
    composed = container  # as typed (parallel=auto stays auto): trainer.replan_on_failure plans it again
    environment = detect()
    try:
        container = elastic_round(container, environment)
        run = resolve(typed_config(container), container, environment)
    except (ConfigError, LaunchError, *STATE_ERRORS) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if run is None:
        return None
    cfg = run.cfg
    run_dir = Path(cfg.paths.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if environment.rank == 0:  # under torchrun/srun every rank runs this function, in one run directory
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        record_composition(run, run_dir)
    if cfg.trainer.dry_run:
        if environment.rank == 0:
            dry_run(run, run_dir)
        return None
    prepare_data(cfg)
    pool = None
    if producer_started_by_launcher(cfg, environment):
        # Disaggregated preprocessing on this host: a producer process on 127.0.0.1 with a fresh key
        # that only this job's processes know (environment, never the saved config). It outlives
        # rank restarts (trainer.max_restarts).
        pool, container = start_producer(cfg, run.container)
        run = run.with_container(container)
    try:
        if environment.external or world_size(cfg) == 1:
            run_worker(run, str(run_dir))
        else:
            job_id = environment.job_id or f"local-{os.getpid()}-{run_dir.name}"
            rendezvous = node_rendezvous(environment) if environment.kind == "node" else {}
            exclude = pool.pids if pool else set()
            with scoped_environment(rendezvous):
                if cfg.trainer.replan_on_failure:  # a lost device: the solver plans the rest (launch/replan.py)
                    from .replan import start_replanning

                    start_replanning(
                        run,
                        composed,
                        lambda again: start_ranks(again, str(run_dir), job_id, exclude=exclude),
                        lambda again: _resolved_again(again, run, environment),
                        str(run_dir),
                    )
                else:
                    start_ranks(run, str(run_dir), job_id, exclude=exclude)
    except RankFailed as error:
        print(f"error: {error} (logs: {run_dir})", file=sys.stderr)
        sys.exit(1)
    finally:
        if pool is not None:
            pool.stop()
    summary = run_dir / SUMMARY_FILE
    if environment.rank != 0 or not summary.is_file():
        # under srun or torchrun each process is one rank and rank 0 reports the run (on a real SLURM a requeued
        # job's other ranks read the first run's summary while rank 0 rewrote it)
        return None
    result = json.loads(summary.read_text())
    if "stopped_at_step" in result and _in_multirun():
        # a preempted or interrupted sweep ends here: its other jobs do not start, and the sweeper does not
        # take this job's loss at the stop for a finished job's
        print(
            f"error: job stopped at step {int(result['stopped_at_step'])} by a signal (checkpoint in {run_dir}); "
            "the sweep ends here",
            file=sys.stderr,
        )
        sys.exit(143)
    return result.get(cfg.optimized_metric)


def record_composition(run, run_dir: Path) -> None:
    """The run's composition (parallel/composition.py) in one log line and in ``composition.json``: what
    conf/proven_compositions.yaml and ``python tools/compositions.py`` say has trained against one process."""
    from ..parallel.composition import composition_of

    composition = composition_of(run)
    log.info("composition: %s", composition.key)
    record = {"key": composition.key, "layout": composition.layout, "precision": composition.precision}
    (run_dir / "composition.json").write_text(json.dumps({**record, "facts": list(composition.facts())}, indent=1))


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def check_producer_reach(cfg: Config) -> None:
    """Several nodes fetch from the one producer rank 0 starts: it must listen beyond the loopback."""
    producer = cfg.data.producer
    if producer.workers > 0 or producer.address is not None:
        if producer.max_connections < world_size(cfg) + 8:
            raise LaunchError(
                f"data.producer.max_connections={producer.max_connections} is too few for "
                f"{world_size(cfg)} trainer ranks (each holds a connection, and reconnects need room); "
                f"set data.producer.max_connections={2 * world_size(cfg) + 8}"
            )
    if cfg.trainer.num_nodes > 1 and producer.workers > 0 and producer.address is None:
        host, _ = split_address(producer.listen)
        if is_loopback(host):
            raise LaunchError(
                f"data.producer.listen={producer.listen} is reachable from this node only, but "
                f"trainer.num_nodes={cfg.trainer.num_nodes} nodes fetch from it; set data.producer.listen to "
                "an address of the private network (e.g. 0.0.0.0:0; the key authenticates every trainer)"
            )


def dry_run(run, run_dir: Path) -> None:
    from ..models.info import model_table
    from ..planner.rehearsal import rehearse

    cfg = run.cfg
    print(model_table(cfg.model))
    print(f"world size {world_size(cfg)}: {cfg.trainer.devices} process(es) x {cfg.trainer.num_nodes} node(s)")
    print("rehearsal: each rank role built on the meta device, model state planned vs counted")
    rehearse(cfg, run_dir, layout=run.layout)


def producer_started_by_launcher(cfg: Config, environment) -> bool:
    """One producer per job: train.py starts it when it starts every rank of the job (one node); otherwise
    (torchrun, srun, several nodes) rank 0 does, and hands its address and key to the others."""
    wanted = cfg.data.producer.workers > 0 and cfg.data.producer.address is None
    return wanted and not environment.external and cfg.trainer.num_nodes == 1


def start_producer(cfg: Config, container: dict):
    from ..data.producer import LocalPool
    from ..data.transport import new_key

    key = cfg.data.producer.key or new_key()
    os.environ["DISTTRAIN_PRODUCER_KEY"] = key
    pool = LocalPool(cfg, container, key)
    address = pool.address
    log.info("%s with %d decode worker(s) each on %s", _producers(cfg), cfg.data.producer.workers, address)
    container = {**container, "data": {**container["data"], "producer": {**container["data"]["producer"]}}}
    container["data"]["producer"]["address"] = address
    return pool, container


def _producers(cfg: Config) -> str:
    count = int(cfg.data.producer.count)
    return "data producer" if count == 1 else f"a pool of {count} data producers"


def start_ranks(run, run_dir: str, job_id: str, exclude: set[int]) -> None:
    """The ranks of this node, started by Fabric's spawn launcher, or by torch's elastic agent for restarts."""
    from ..comm import flight

    cfg = run.cfg
    flight.configure(run_dir, rank=-1)  # torch's recorder reads its settings as a process group is made
    if cfg.trainer.fault_tolerance.enabled:  # replica groups, each replaced alone (launch/replica_groups.py)
        from .replica_groups import run_replica_groups

        run_replica_groups(run, run_dir, job_id)
        return
    if cfg.trainer.max_restarts > 0:
        spawn_with_restarts(cfg, elastic_worker, (run, run_dir), run_dir, job_id)
        return
    fabric_kwargs = {
        "accelerator": run.accelerator,
        "devices": cfg.trainer.devices,
        "num_nodes": cfg.trainer.num_nodes,
        "precision": "32-true" if run.precision == "32" else run.precision,
        "backend": run.backend,
    }
    spawn_with_fabric(cfg, fabric_kwargs, fabric_worker, (run, run_dir), job_id, exclude)
