"""Engines: how one optimizer step's forward and backward run on this process.

* ``DataParallelEngine``: the whole model on every process, DDP (through
  Fabric) averaging gradients on the last microbatch.
* ``UnitEngine`` (train/unit_engine.py): every other layout -- pipeline stages,
  tensor parallelism, disaggregated units -- with ZeRO-1.

Both see the same microbatches and the same global loss normalization, so their
results agree with a single process. Model and optimizer state are checkpointed
*by parameter name* (train/state.py), each rank its own shards, so a checkpoint
written with one layout loads into another.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext

import torch
import torch.distributed as dist
from lightning_fabric import Fabric

from ..comm.buckets import bucket_numel
from ..comm.engine import allreduce_gradients
from ..config import Config, training_precision
from ..data.batch import Batch
from ..data.tokenizer import Tokenizer
from ..models import build_model, materialize
from ..parallel.compile import apply_compile
from ..parallel.expert_parallel import configure_moe, moe_step_stats, update_biases
from ..parallel.float8 import apply_float8, precompute_fp8_scales
from ..parallel.recompute import apply_recompute
from ..schedule.executor import StepRecord
from .optim import build_optimizer
from .state import model_entries, optimizer_entries, owned_by

log = logging.getLogger(__name__)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without blocking the host: pinned and copied asynchronously on CUDA."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def batch_to_device(batch: Batch, device: torch.device) -> Batch:
    return batch.map(lambda tensor: to_device(tensor, device))


class GlobalCounts:
    """The global batch's loss tokens, generation samples, sequences and images, on the device.

    Reduced over the data-parallel replicas asynchronously: the reduction is waited for only when the
    first loss is normalized (on NCCL a stream dependency, not a host wait), so it never queues a step's
    start behind parameter gathers still on the wire. Calling it returns ``(n_tokens, n_gen)``, the loss
    normalizers, as device tensors: nothing is read on the host.
    """

    def __init__(self, values: torch.Tensor, work=None, trace=None):
        self.values, self.work, self.trace = values, work, trace
        self.normalizers: tuple[torch.Tensor, torch.Tensor] | None = None

    def reduced(self) -> torch.Tensor:
        """All four counts once their reduction is done (what the loop logs). Ranks that compute no loss (a
        pipeline's first stages) never call the normalizers, so they wait here, at the end of the step: on
        NCCL a stream dependency, not a host wait."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.values

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.normalizers is None:
            started = self.trace.now() if self.trace is not None else None
            if self.work is not None:
                self.work.wait()
                self.work = None
            if self.trace is not None:
                self.trace.compute("wait: batch counts", started, self.trace.now())
            normalizers = self.values[:2].float().clamp(min=1.0)  # fp32, as the loss sums
            self.normalizers = (normalizers[0], normalizers[1])
        return self.normalizers


def import_pretrained(cfg: Config, tokenizer: Tokenizer, modules: list[torch.nn.Module]) -> None:
    """``model.init_from``: Hugging Face weights into this rank's parameters (models/hf/), before the optimizer
    copies them; parameters it leaves out are listed (an error unless ``model.init_from_strict=false``)."""
    if cfg.model.init_from in (None, ""):
        return
    from ..models.hf import load_pretrained

    names = [name for name, _ in build_model(cfg.model, tokenizer, device="meta").named_parameters()]
    missing = load_pretrained(modules, cfg.model, names)
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(
            "model.init_from: %d of %d parameter tensors imported%s",
            len(names) - len(missing),
            len(names),
            f"; {len(missing)} keep their initialization (init_from_strict=false), e.g. {missing[0]}"
            if missing
            else "",
        )


class Engine:
    named_parameters: list[tuple[str, torch.nn.Parameter]]
    optimizer: object | None = None
    stop_request = None  # the trainer's (train/stop.py), for engines that agree on stopping themselves
    float8_scales = False  # model.float8=tensorwise under FSDP2: weights' FP8 scales computed after each step

    def build_optimizer(self):
        """Plain AdamW over this process's parameters (the unit engine shards it: ZeRO-1)."""
        self.optimizer = build_optimizer(self.named_parameters, self.cfg.optim)
        return self.optimizer

    def checkpoint_state(self, saving: bool) -> dict:
        """This rank's parameters, persistent buffers and optimizer state by name (train/state.py): the live
        tensors, so a load writes in place. ``saving`` lets a sharded engine skip what another rank writes."""
        raise NotImplementedError

    def checkpoint_loaded(self, absent: list[str]) -> None:
        """After a load into :meth:`checkpoint_state` (``absent``: the keys the checkpoint lacked): rebuild
        what derives from the loaded tensors."""

    def forward_backward(self, microbatches: list[Batch], counts: GlobalCounts, record: bool = False) -> StepRecord:
        """Forward and backward of every microbatch; losses are normalized by ``counts()``."""

    def after_backward(self) -> None:
        """Make gradients global (sum over data-parallel replicas) if the engine has not already."""

    def evaluate(self, microbatches: list[Batch]) -> torch.Tensor:
        """[lm, gen] loss sums (fp64, on the device) of ``microbatches`` -- this process's share of a held-out
        global batch -- summed over the data-parallel replicas, one copy each: forwards only, every module in
        eval mode (MoE routers count no load), no gradients, no optimizer or data state touched."""
        flags = [(m, m.training) for root in self.eval_models() for m in root.modules()]
        for module, _ in flags:
            module.training = False
        try:
            with torch.no_grad():
                return self.loss_sums(microbatches)
        finally:
            for module, flag in flags:
                module.training = flag

    def loss_sums(self, microbatches: list[Batch]) -> torch.Tensor:
        """:meth:`evaluate`'s forwards (under no_grad, in eval mode)."""
        raise NotImplementedError

    def eval_models(self) -> list[torch.nn.Module]:
        """The modules :meth:`evaluate` runs (in eval mode): this process's models."""
        return self.models()

    def count_group(self, step: int, default):
        """The group step ``step``'s loss counts are summed over when each replica reads its own samples
        (``default``: the trainer's for this layout; local SGD: one worker's after its warm-up)."""
        return default

    def loss_replicas(self, step: int) -> range | None:
        """The data-parallel replicas whose samples normalize step ``step``'s loss when every process reads the
        whole step (None: all of them, the global batch; local SGD: one worker's after its warm-up)."""
        return None

    def synchronize(self) -> None:
        """Finish communication still in flight that writes parameters (overlapped gathers)."""

    def close(self) -> None:
        """Stop background communication (threads, hooks) at the end of training."""

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` (inf: no clipping); returns the global norm before clipping (on the device)."""
        raise NotImplementedError

    def replica_gradients(self) -> list[torch.nn.Parameter]:
        """Whose ``.grad`` hold the reduced gradients a fault-tolerant job sums over its groups: the parameters."""
        return [p for _, p in self.named_parameters]

    def models(self) -> list[torch.nn.Module]:
        """The model modules this process runs."""
        return []

    def called_modules(self) -> list[torch.nn.Module]:
        """The modules a step calls (fault drills hook their forward and backward): :meth:`models` here."""
        return self.models()

    def batch_fields(self) -> tuple[str, ...] | None:
        """The Batch fields this process's model reads (None: all of them); a data producer sends it only these
        (data.producer.per_rank) and the others arrive as zeros of their shapes."""
        return None

    def window_metrics(self, seconds: float, steps: int) -> dict[str, float]:
        """Engine-specific metrics of the ``steps`` steps (``seconds`` long) since the last log."""
        return {}

    def whole_run_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The logged window's throughput for the whole run, from this process's view of it (local SGD: one
        worker's counts)."""
        return metrics

    # Where the loop's agreements come from. Every rank takes the same steps, so the step decides; A-EDiT's
    # workers take different numbers of steps and agree only at their syncs (train/local_sgd/engine.py).
    def keep_going(self, step: int, stop_at: int) -> bool:
        """Whether the loop takes another step."""
        return step < stop_at

    def checkpoint_due(self, step: int, every: int) -> bool:
        """Whether to save a checkpoint after ``step`` (``every``: trainer.checkpoint.every_n_steps, 0 off)."""
        return bool(every) and step % every == 0

    def stop_agreed(self, stop_request) -> bool:
        """Whether the ranks agreed to stop after this step (a signal on some rank, train/stop.py)."""
        return stop_request.agreed()

    def host_reads(self, step: int) -> bool:
        """Whether step ``step`` reads values on the host by design (trainer.sync_debug does not check it)."""
        return False

    def checkpoint_step(self, step: int) -> int:
        """The step a checkpoint saved after this process's ``step`` is named after (the same on every rank)."""
        return step

    def resumed_step(self, step: int) -> int:
        """This process's step after loading the checkpoint named ``step``."""
        return step

    def after_step(self) -> None:
        """After the optimizer step: aux-loss-free MoE routers move their expert biases; FSDP2's FP8 weights
        get their scales for the next all-gather (parallel/float8.py)."""
        update_biases(self.models())
        if self.float8_scales:
            precompute_fp8_scales(self.models())

    def moe_stats(self) -> torch.Tensor | None:
        """[assignments dropped for capacity over the world, worst max/mean expert load] of the step (on the
        device; None for a dense model). A collective on every rank of an MoE model."""
        if self.cfg.model.llm.moe is None:
            return None
        device = self.fabric.device
        local = moe_step_stats(self.models())
        stats = local.to(device) if local is not None else torch.zeros(2, dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dropped, ratio = stats[:1].clone(), stats[1:].clone()
            dist.all_reduce(dropped)
            dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
            stats = torch.cat([dropped, ratio])
        return stats


def _loss(out: dict, n_tokens: torch.Tensor, n_gen: torch.Tensor, weight: float, scale: float = 1.0) -> torch.Tensor:
    loss = out["lm_loss_sum"] / n_tokens
    if "gen_loss_sum" in out:
        loss = loss + weight * out["gen_loss_sum"] / n_gen
    return loss * scale


def clip_by_norm(params: list[torch.nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients by min(1, max_norm / norm) on the device (torch's clipping, no host read). DTensor
    parameters on different meshes (FSDP2 + TP: 2-D for TP weights, 1-D for replicated norms) are clipped
    one mesh at a time: a foreach op takes one mesh."""
    if not (math.isfinite(max_norm) and params):
        return
    by_mesh: dict[int, list] = {}
    for param in params:
        by_mesh.setdefault(id(getattr(param, "device_mesh", None)), []).append(param)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)


class DataParallelEngine(Engine):
    """The whole model on every process; PyTorch DDP averages gradients on the last microbatch.

    The model is wrapped with DDP directly rather than through ``fabric.setup_module``: Fabric's
    wrapper casts every floating-point *input* to bf16 under bf16-mixed, which would quantize the
    diffusion noise targets; here only the forward runs under autocast.
    """

    def __init__(self, cfg: Config, fabric: Fabric, tokenizer: Tokenizer, unit, group=None):
        """``unit``: the run's one unit (its recompute policy); ``group``: the processes DDP averages over (None:
        all of them; local SGD: one worker's)."""
        self.cfg, self.fabric = cfg, fabric
        self.group = group
        self.replicas = dist.get_world_size(group) if group is not None else fabric.world_size
        # The group a step's loss sums are reduced over for logging: the one its loss counts are reduced over.
        self.loss_group = group
        self.loss_multiplier = 1.0  # local SGD's injected spikes scale a worker's loss (the logged sums are not)
        self.raw_model = build_model(cfg.model, tokenizer, device="meta")
        apply_float8(self.raw_model, cfg.model.float8)  # model.float8: the LLM blocks' linears (parallel/float8.py)
        # local SGD's sharded workers: FSDP2 over the group (on meta, before materialize) or ZeRO-1's optimizer
        self.sharded = self.shard_model(self.raw_model)
        materialize(self.raw_model, fabric.device, seed=cfg.trainer.seed, std=cfg.model.init_std)
        import_pretrained(cfg, tokenizer, [self.raw_model])
        apply_recompute(self.raw_model, unit.recompute, unit.recompute_every)
        if cfg.trainer.compile:  # per block, around recompute's wrapper (parallel/compile.py): the hooks of DDP
            apply_compile(self.raw_model)  # and a local-SGD worker's FSDP2 stay eager and keep their overlap
        module = self.raw_model
        self.model = module
        comm = cfg.parallel.comm
        # DDP overlaps its bucketed all-reduces with backward. Without overlap (or skipping communication
        # for a compute-only benchmark) every microbatch runs under no_sync and after_backward reduces.
        self.ddp_sync = comm.overlap_grad_reduce and not comm.skip_collectives
        self.bucket_numel = bucket_numel(comm.bucket_mb)
        if self.replicas > 1 and not self.sharded:
            device_ids = [fabric.device.index] if fabric.device.type == "cuda" else None
            bucket_mb = comm.bucket_mb if comm.bucket_mb > 0 else 1e6
            # Gradients are views of DDP's buckets: no second copy (16 bytes per parameter, not 20). Every
            # buffer here is a constant each rank builds identically (rope tables, pixel statistics, a frozen
            # VAE's weights): DDP need not broadcast them before every forward.
            self.model = torch.nn.parallel.DistributedDataParallel(
                module,
                device_ids=device_ids,
                bucket_cap_mb=bucket_mb,
                gradient_as_bucket_view=True,
                broadcast_buffers=False,
                process_group=group,
            )
        mixed = training_precision(cfg.trainer.precision, fabric.device.type) != "32"
        self.autocast = fabric.autocast if mixed else nullcontext
        self.named_parameters = [(n, p) for n, p in self.raw_model.named_parameters() if p.requires_grad]

    def shard_model(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` (on the meta device) is sharded over ``group`` (FSDP2, which it then applies) or
        its gradients reduced by a sharded optimizer (ZeRO-1): either sums gradients and replaces DDP. Plain
        data parallelism replicates (DDP); local SGD's workers may shard (train/local_sgd/engine.py)."""
        return False

    def last_backward(self) -> None:
        """Before the step's last backward (a sharded optimizer reduces gradient buckets as they complete)."""

    def models(self) -> list[torch.nn.Module]:
        return [self.raw_model]

    def checkpoint_state(self, saving: bool) -> dict:
        state = {**model_entries([self.raw_model]), **optimizer_entries(self.optimizer, self.named_parameters)}
        # Every replica holds all of it: each saves its share (loading reads everything).
        return owned_by(state, self.fabric.global_rank, self.fabric.world_size) if saving else state

    def forward_backward(self, microbatches, counts, record=False) -> StepRecord:
        device = self.fabric.device
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # lm, gen loss sums: kept on the device
        # DDP averages gradients over its replicas; scale so the result is the sum over them, normalized by
        # the counts (the global batch's, or one local-SGD worker's). FSDP2 and ZeRO-1 sum.
        scale = 1.0 if self.sharded else float(self.replicas)
        # MoE aux terms: balanced over every replica (one global microbatch), averaged over the microbatches.
        balance = dist.group.WORLD if self.fabric.world_size > 1 else None
        configure_moe([self.raw_model], balance, scale / len(microbatches))
        for index, microbatch in enumerate(microbatches):
            last = index == len(microbatches) - 1 and self.ddp_sync
            sync = self.model.no_sync() if self.replicas > 1 and not last and not self.sharded else nullcontext()
            if index == len(microbatches) - 1:
                self.last_backward()
            with sync:
                with self.autocast():
                    out = self.model(batch_to_device(microbatch, device))
                _loss(out, *counts(), self.cfg.model.gen_loss_weight, scale=scale * self.loss_multiplier).backward()
            for position, name in enumerate(("lm_loss_sum", "gen_loss_sum")):
                if name in out:
                    totals[position] += out[name].detach().double()
        work = None
        loss_group = self.loss_group
        loss_group_size = dist.get_world_size(loss_group) if loss_group is not None else self.fabric.world_size
        if loss_group_size > 1:  # every process logs the losses its counts normalize; read at logging steps
            work = dist.all_reduce(totals, group=loss_group, async_op=True)

        def reduced() -> dict[str, torch.Tensor]:
            if work is not None:
                work.wait()
            return {"lm_loss_sum": totals[0], "gen_loss_sum": totals[1]}

        return StepRecord(pending_sums=reduced)

    def loss_sums(self, microbatches: list[Batch]) -> torch.Tensor:
        device = self.fabric.device
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        for microbatch in microbatches:  # the model itself: DDP's hooks are for training's gradients
            with self.autocast():
                out = self.raw_model(batch_to_device(microbatch, device))
            for position, name in enumerate(("lm_loss_sum", "gen_loss_sum")):
                if name in out:
                    sums[position] += out[name].double()
        size = dist.get_world_size(self.loss_group) if self.loss_group is not None else self.fabric.world_size
        if size > 1:
            dist.all_reduce(sums, group=self.loss_group)
        return sums

    def after_backward(self) -> None:
        comm = self.cfg.parallel.comm
        if self.replicas > 1 and not self.sharded and not self.ddp_sync and not comm.skip_collectives:
            params = [p for _, p in self.named_parameters]
            allreduce_gradients(params, self.group, self.bucket_numel, self.replicas)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        params = [p for _, p in self.named_parameters if p.grad is not None]
        # DDP gradients are already identical on every process: the local norm is the global one.
        grads = [p.grad for p in params]
        norm = (
            torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros((), device=self.fabric.device)
        )
        clip_by_norm(params, norm, max_norm)
        return norm
