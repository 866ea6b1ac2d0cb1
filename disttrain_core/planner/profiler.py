"""Benchmark trials of each module on this machine, for the planner's profiled cost model.

For every present module (encoder with its projector, LLM, generator with its projector),
every TP size the planner may use (up to the number of processes) and a few input sizes,
``world`` processes run forward + backward together -- as many as training will run, with
the same threads per process, so the trials see the same contention as the real run; at
TP > 1 they form TP groups and the blocks are sharded exactly as the trainer shards them.
The median of ``repeats`` timed runs after a warm-up is kept, and the planner interpolates
piecewise-linearly between input sizes (costs.interp).

The same processes also measure point-to-point and all-reduce bandwidth and latency (for
pipeline transfers and ZeRO-1 traffic) and the AdamW step time per parameter. On GPUs every trial is
timed with CUDA events after a synchronization (a host clock would time the launches) and the links
are measured on device tensors over NCCL, the backend training uses; they are this node's links, so
the planner takes them for the intra-node figures only and keeps the preset's inter-node ones.

Results are cached as JSON under ``planner.profile_cache``, keyed by CPU/GPU model, process
count, threads, precision, torch version and a hash of the model config: a second
``parallel=auto`` run reuses them without spawning anything.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from omegaconf import OmegaConf

from ..base.net import free_port
from .costs import interp
from .solver import PlanningError

PROFILE_VERSION = 4  # 3: device timings from CUDA events, links over the device's backend; 4: the side units timed
# Items per trial of each unit: images, sequences, generation targets, clips, frame groups, audio targets.
SIZES = {"encoder": (2, 4, 8, 16, 32), "llm": (1, 2, 4, 8), "generator": (1, 2, 4, 8)}
SIZES.update(audio_encoder=(1, 2, 4, 8), video_encoder=(1, 2, 4, 8), audio_generator=(1, 2, 4, 8))


@dataclass
class Profile:
    key: str
    world: int
    threads: int
    precision: str
    trials: dict[str, list[list[float]]] = field(default_factory=dict)  # "unit/tp" -> [[items, seconds], ...]
    p2p_bw: float = 0.0  # bytes/s
    allreduce_bw: float = 0.0  # bytes/s of the ring formula's 2 (n-1)/n payload
    latency_s: float = 0.0
    optimizer_s_per_param: float = 0.0
    copy_s_per_param: float = 0.0
    seconds: float = 0.0  # how long profiling took
    link_backend: str = "gloo"  # what carried the link trials: gloo (CPU tensors) or nccl (GPU tensors)

    def has(self, unit: str, tp: int) -> bool:
        return f"{unit}/{tp}" in self.trials

    def compute(self, unit: str, tp: int, items: float) -> float:
        return interp([tuple(p) for p in self.trials[f"{unit}/{tp}"]], items)

    def tp_sizes(self, unit: str) -> list[int]:
        return sorted(int(k.split("/")[1]) for k in self.trials if k.startswith(unit + "/"))


def profile_key(model_cfg, world: int, threads: int, precision: str, device: str) -> str:
    import torch

    from ..train.perf import _cpu_model

    name = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else _cpu_model()
    model_hash = hashlib.sha256(OmegaConf.to_yaml(model_cfg).encode()).hexdigest()[:16]
    parts = (f"v{PROFILE_VERSION}", name, f"world={world}", f"threads={threads}", precision, torch.__version__)
    parts += (model_hash,)
    return "|".join(parts)


def cache_path(cache_dir: str, key: str) -> Path:
    return Path(cache_dir) / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def available_memory_bytes(device: str) -> float:
    """Memory a profiling run may use: the host's available RAM, or one CUDA device's memory."""
    if device == "cuda":
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def profiling_processes(cfg, devices: int, work, progress=print) -> int:
    """How many processes the profiler may start (0: do not profile; costs are then analytic).

    Never more than the machine has devices (CUDA) or than will train (CPU). Every profiling process
    materializes the whole model in fp32 and keeps one module's gradients: if that cannot fit in memory,
    profiling is skipped (``planner.cost=auto``) or refused (``planner.cost=profiled``) before anything
    starts.
    """
    import torch

    device = "cuda" if cfg.cluster.device == "cuda" else "cpu"
    world = devices
    if device == "cuda":
        world = min(world, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    params = sum(u.params for u in work.units.values())
    largest = max(u.params for u in work.units.values())
    per_process = 4.0 * (params + largest)
    processes_per_memory = 1 if device == "cuda" else max(world, 1)
    needed, have = per_process * processes_per_memory, 0.8 * available_memory_bytes(device)
    if world and needed <= have:
        return world
    why = (
        f"profiling {cfg.model.name} needs about {needed / 1e9:,.1f} GB ({processes_per_memory} process(es), each "
        f"holding the fp32 model and one module's gradients) and this machine has {have / 1e9:,.1f} GB to spare"
        if world
        else "this machine has no CUDA device to profile on"
    )
    if cfg.planner.cost == "profiled":
        raise PlanningError(f"planner.cost=profiled: {why}; use planner.cost=analytic, or plan on the target machine")
    progress(f"{why}: compute times are analytic (planner.cost=analytic)")
    return 0


def load_or_profile(cfg, world: int, tp_options: list[int], progress=print) -> Profile:
    """The cached profile for this machine, model and process count, or a fresh one."""
    device = "cuda" if cfg.cluster.device == "cuda" else "cpu"
    threads = _threads(cfg, world)
    from .costs import planned_precision

    precision = planned_precision(cfg)
    key = profile_key(cfg.model, world, threads, precision, device)
    path = cache_path(cfg.planner.profile_cache, key)
    try:
        raw = json.loads(path.read_text())
        if raw.get("key") == key:
            return Profile(**raw)
    except (OSError, ValueError, TypeError):
        pass
    progress(f"profiling {cfg.model.name} on {world} process(es) x {threads} thread(s) (cached afterwards) ...")
    profile = run_profile(cfg, world, threads, [t for t in tp_options if world % t == 0], key, device, precision)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(profile.__dict__, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    progress(f"profiled in {profile.seconds:.0f}s -> {path}")
    return profile


def _threads(cfg, world: int) -> int:
    if cfg.trainer.threads_per_rank:
        return int(cfg.trainer.threads_per_rank)
    return max(1, (os.cpu_count() or 1) // max(world, 1))


def run_profile(cfg, world: int, threads: int, tp_sizes: list[int], key: str, device: str, precision: str) -> Profile:
    import torch.multiprocessing as mp

    started = time.perf_counter()
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    payload = {key: OmegaConf.to_container(cfg[key], resolve=True) for key in ("model", "trainer", "planner")}
    payload["trainer"]["precision"] = precision
    processes = [
        ctx.Process(target=_worker, args=(rank, world, port, threads, payload, tp_sizes, device, queue))
        for rank in range(world)
    ]
    for p in processes:
        p.start()
    result = None
    deadline = time.time() + 1800
    while result is None and time.time() < deadline:
        if not queue.empty():
            result = queue.get()
            break
        if any(p.exitcode not in (None, 0) for p in processes):
            break
        time.sleep(0.2)
    for p in processes:
        p.join(timeout=60)
        if p.is_alive():
            p.terminate()
    if result is None or "error" in result:
        raise RuntimeError(f"profiling failed: {result.get('error') if result else 'a worker died'}")
    seconds = time.perf_counter() - started
    return Profile(key=key, world=world, threads=threads, precision=precision, seconds=seconds, **result)


# ---------------------------------------------------------------------------------- workers
def _worker(rank, world, port, threads, payload, tp_sizes, device, queue):  # pragma: no cover - subprocess
    import traceback

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    try:
        backend = "gloo"
        if device == "cuda":  # the links training uses: NCCL between this node's GPUs
            torch.cuda.set_device(rank % max(torch.cuda.device_count(), 1))
            backend = "nccl"
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=300))
        result = _trials(rank, world, payload, tp_sizes, device)
        result["link_backend"] = backend
        if rank == 0:
            queue.put(result)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # report instead of hanging the parent
        if rank == 0:
            queue.put({"error": traceback.format_exc()[-2000:]})
        raise


def _trial_loss(cfg, modules, unit: str, items: int, dev):
    """Forward of one unit (with its projector) on ``items`` random items, as training runs it, to a scalar."""
    import torch

    m = cfg.model
    if unit in ("encoder", "video_encoder"):  # images [N, 3, H, W]; frame groups [N, k, 3, H, W]
        spec = m[unit]
        group = (int(spec.temporal_merge),) if unit == "video_encoder" else ()
        shape = (items, *group, 3, spec.image_size, spec.image_size)
        pixels = torch.randint(0, 255, shape, dtype=torch.uint8, device=dev)
        projector = modules["encoder_projector" if unit == "encoder" else "video_projector"]
        return projector(modules[unit](pixels)).float().square().mean()
    if unit == "audio_encoder":  # log-mel features [N, n_mels, frames]
        from ..data.audio import audio_frames

        mels = torch.randn(items, m.audio_encoder.n_mels, audio_frames(m.audio_encoder), device=dev)
        return modules["audio_projector"](modules["audio_encoder"](mels)).float().square().mean()
    if unit == "llm":
        llm = modules["llm"]
        hidden = torch.randn(items, m.seq_len, m.llm.dim, device=dev, requires_grad=True)
        targets = torch.randint(0, m.llm.vocab_size, (items, m.seq_len), device=dev)
        # the head with its loss as training runs it (vocabulary-parallel under TP, chunked with model.loss_chunk)
        return llm.output(llm.final_norm(llm.run_layers(hidden)), targets) / targets.numel()
    from ..models.flops import latent_grid  # the image or the audio generator: a U-Net on its latent grid

    spec = m[unit]
    height, width = latent_grid(m, spec)
    queries = torch.randn(items, m.gen_tokens, m.llm.dim, device=dev, requires_grad=True)
    context = modules[f"{unit}_projector"](queries)
    latents = torch.randn(items, spec.in_channels, height, width, device=dev)
    steps = torch.randint(0, spec.num_train_timesteps, (items,), device=dev)
    return modules[unit].unet(latents, steps, context).float().square().mean()


def _trial_step(cfg, modules, unit: str, items: int, dev, bf16: bool) -> None:
    """One training step's forward and backward of ``unit`` on ``items`` random items."""
    import torch

    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
        loss = _trial_loss(cfg, modules, unit, items, dev)
    if loss.requires_grad:  # a frozen encoder with a frozen projector runs forward only
        loss.backward()


def _timed(fn, repeats: int, device=None) -> float:
    """Median seconds of ``fn`` after a warm-up. On a GPU: between CUDA events, the device idle at the start
    (synchronized: profiling is not the hot path) and waited for at the end."""
    import torch
    import torch.distributed as dist

    from ..base.clock import DeviceClock

    clock = DeviceClock(device if device is not None else torch.device("cpu"))
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if clock.cuda:
            torch.cuda.synchronize(clock.device)
        dist.barrier()
        start = clock.stamp()
        fn()
        times.append(clock.elapsed(start, clock.stamp()))
    return statistics.median(times)


def _trials(rank, world, payload, tp_sizes, device):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from ..config import Config
    from ..data.tokenizer import ByteTokenizer
    from ..models import build_model, materialize
    from ..parallel.tensor_parallel import apply_tensor_parallel
    from .workload import workload_of

    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(payload))
    repeats = int(cfg.planner.profile_repeats)
    bf16 = str(cfg.trainer.precision).startswith("bf16")
    dev = torch.device(device if device == "cpu" else f"cuda:{rank % max(torch.cuda.device_count(), 1)}")
    work = workload_of(cfg.model)
    trials: dict[str, list[list[float]]] = {}
    torch.manual_seed(rank)

    for tp in tp_sizes:
        groups = [dist.new_group(list(range(g, g + tp))) for g in range(0, world, tp)]  # tp divides world
        mesh = DeviceMesh.from_group(groups[rank // tp], device) if tp > 1 else None
        model = build_model(cfg.model, ByteTokenizer(), device="meta")
        materialize(model, dev, seed=1, std=cfg.model.init_std)
        modules = model.submodules()
        if mesh is not None:
            apply_tensor_parallel(model, mesh, sequence_parallel=bool(cfg.parallel.sequence_parallel))

        for unit in SIZES:
            if unit not in work.units or not work.units[unit].tp_allowed(tp):
                continue
            points = []
            for items in SIZES[unit]:
                seconds = _timed(functools.partial(_trial_step, cfg, modules, unit, items, dev, bf16), repeats, dev)
                points.append([float(items), seconds])
            gathered = [None] * world
            dist.all_gather_object(gathered, points)
            # the slowest replica sets the pace (a synchronous step waits for it)
            trials[f"{unit}/{tp}"] = [[p[0], max(g[i][1] for g in gathered)] for i, p in enumerate(points)]
        del model, modules

    # communication and optimizer step
    p2p_bw = allreduce_bw = latency = 0.0
    if world > 1:
        small = torch.zeros(1, device=dev)
        big = torch.zeros(8 * 2**20 // 4, device=dev)

        def pingpong(t):
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            elif rank == 1:
                dist.recv(t, 0)
                dist.send(t, 0)

        latency = _timed(lambda: pingpong(small), 10, dev) / 2
        p2p_bw = big.numel() * 4 / max(_timed(lambda: pingpong(big), repeats, dev) / 2 - latency, 1e-9)
        ar = _timed(lambda: dist.all_reduce(big), repeats, dev)
        allreduce_bw = 2 * (world - 1) / world * big.numel() * 4 / max(ar - 2 * (world - 1) * latency, 1e-9)
    n = 2**22
    param = torch.zeros(n, requires_grad=True, device=dev)
    param.grad = torch.randn(n, device=dev)
    opt = torch.optim.AdamW([param], lr=1e-4, foreach=True)
    optimizer_s = _timed(opt.step, repeats, dev) / n
    flat = torch.zeros(n, device=dev)
    copy_s = _timed(lambda: param.data.copy_(flat), repeats, dev) / n
    return {
        "trials": trials,
        "p2p_bw": p2p_bw,
        "allreduce_bw": allreduce_bw,
        "latency_s": latency,
        "optimizer_s_per_param": optimizer_s,
        "copy_s_per_param": copy_s,
    }
