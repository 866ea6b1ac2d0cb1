"""The training loop: data -> forward/backward over microbatches -> optimizer
-> checkpoint -> metrics.

Loss normalization is global: before the microbatches of a step run, the
ranks agree (one all-reduce) on the number of loss tokens and generation
targets in the whole global batch, and every microbatch divides its summed
losses by those totals. The accumulated gradient is then exactly the gradient
of the global-batch mean loss, whatever the number of processes and
microbatches -- which is what makes a 2-process run reproduce a 1-process run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning_fabric import Fabric
from omegaconf import OmegaConf
from tqdm import tqdm

from ..config import Config
from ..data.batch import Batch
from ..data.loader import MicrobatchLoader
from ..data.reader import ShardStream, resolve_shards
from ..data.samples import SampleEncoder
from ..data.tokenizer import build_tokenizer
from ..models import build_model, materialize
from ..models.flops import batch_flops
from .checkpoint import CheckpointManager, load_file, read_meta, resolve_resume
from .metrics import MetricsLogger
from .optim import build_optimizer, build_scheduler
from .perf import peak_flops_per_device, peak_memory_gib

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    loss: float
    lm_loss: float
    gen_loss: float
    grad_norm: float
    lr: float
    sequences: int
    images: int
    loss_tokens: int
    data_wait_s: float
    step_time_s: float


class Trainer:
    def __init__(self, cfg: Config, fabric: Fabric, run_dir: str | Path):
        self.cfg = cfg
        self.fabric = fabric
        self.run_dir = Path(run_dir)
        self.rank = fabric.global_rank
        self.world_size = fabric.world_size
        # Pure data parallelism: every process is its own data-parallel rank.
        self.dp_rank, self.dp_size = self.rank, self.world_size
        trainer, optim = cfg.trainer, cfg.optim
        self.accumulation = optim.global_batch_size // (optim.micro_batch_size * self.dp_size)

        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        self.raw_model = build_model(cfg.model, self.tokenizer, device="meta")
        materialize(self.raw_model, fabric.device, seed=trainer.seed, std=cfg.model.init_std)
        module = torch.compile(self.raw_model) if trainer.compile else self.raw_model
        self.model = fabric.setup_module(module)
        self.optimizer = fabric.setup_optimizers(build_optimizer(list(self.raw_model.named_parameters()), optim))
        self.scheduler = build_scheduler(self.optimizer, optim, trainer.max_steps)

        shards = resolve_shards(cfg.data.path)
        self.stream = ShardStream(
            shards, self.dp_rank, self.dp_size, seed=trainer.seed, shuffle=cfg.data.shuffle_shards
        )
        self.encoder = SampleEncoder(
            cfg.model, self.tokenizer, seed=trainer.seed, max_image_pixels=cfg.data.max_image_pixels
        )
        self.checkpoints = CheckpointManager(
            self.run_dir / "checkpoints",
            rank=self.rank,
            world_size=self.world_size,
            barrier=fabric.barrier,
            keep_last=trainer.checkpoint.keep_last,
            async_save=trainer.checkpoint.async_save,
        )
        self.step = 0
        data_state = self._resume()
        self.loader = MicrobatchLoader(
            self.stream,
            self.encoder,
            optim.micro_batch_size,
            self.accumulation,
            num_workers=cfg.data.num_workers,
            prefetch_steps=cfg.data.prefetch_steps,
            worker_nice=cfg.data.worker_nice,
            state=data_state,
        )
        self.metrics = MetricsLogger(
            self.run_dir, enabled=self.rank == 0, tensorboard=cfg.logger.tensorboard, jsonl=cfg.logger.jsonl
        )
        self.peak_flops = peak_flops_per_device(
            cfg.trainer.precision, fabric.device, cfg.cluster.peak_flops_bf16, cfg.cluster.peak_flops_fp32
        )

    # ------------------------------------------------------------------ resume
    def _data_file(self) -> str:
        return f"data_dp{self.dp_rank:05d}.json"

    def _resume(self) -> dict | None:
        checkpoint = resolve_resume(self.cfg.trainer.resume, self.run_dir)
        if checkpoint is None:
            return None
        meta = read_meta(checkpoint)
        if meta.get("dp_size") != self.dp_size:
            raise ValueError(
                f"checkpoint {checkpoint} was written with {meta.get('dp_size')} data-parallel ranks, this run "
                f"has {self.dp_size}; resume with the same trainer.devices * trainer.num_nodes"
            )
        self.raw_model.load_state_dict(load_file(checkpoint, "model.pt"))
        self.optimizer.load_state_dict(load_file(checkpoint, "optimizer.pt"))
        state = load_file(checkpoint, "trainer.pt")
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        log.info("resumed from %s at step %d", checkpoint, self.step)
        return load_file(checkpoint, self._data_file())

    def save_checkpoint(self) -> None:
        files: dict = {self._data_file(): self.loader.state_dict()}
        if self.rank == 0:
            files["model.pt"] = self.raw_model.state_dict()
            files["optimizer.pt"] = self.optimizer.state_dict()
            files["trainer.pt"] = {"step": self.step, "scheduler": self.scheduler.state_dict()}
        meta = {"dp_size": self.dp_size, "model": self.cfg.model.name, "torch": torch.__version__}
        self.checkpoints.save(self.step, files, meta)

    # -------------------------------------------------------------------- step
    def _global_counts(self, microbatches: list[Batch]) -> torch.Tensor:
        local = torch.tensor(
            [
                sum(mb.loss_tokens() for mb in microbatches),
                sum(mb.gen_samples() for mb in microbatches),
                sum(mb.size for mb in microbatches),
                sum(int(mb.images.shape[0]) for mb in microbatches),
            ],
            dtype=torch.float64,
            device=self.fabric.device,
        )
        return self.fabric.all_reduce(local, reduce_op="sum") if self.world_size > 1 else local

    def train_step(self) -> StepResult:
        started = time.perf_counter()
        microbatches = self.loader.next_step()
        data_wait = time.perf_counter() - started
        counts = self._global_counts(microbatches)
        n_tokens, n_gen = max(counts[0].item(), 1.0), max(counts[1].item(), 1.0)
        weight = self.cfg.model.gen_loss_weight
        sums = torch.zeros(2, dtype=torch.float64, device=self.fabric.device)
        for index, microbatch in enumerate(microbatches):
            microbatch = microbatch.to(self.fabric.device)
            last = index == len(microbatches) - 1
            with self.fabric.no_backward_sync(self.model, enabled=not last):
                out = self.model(microbatch)  # Fabric's module wrapper applies the precision's autocast
                lm = out["lm_loss_sum"] / n_tokens
                gen = out["gen_loss_sum"] / n_gen if "gen_loss_sum" in out else torch.zeros((), device=lm.device)
                # DDP averages gradients over ranks; scale so the result is the global-batch gradient.
                self.fabric.backward((lm + weight * gen) * self.world_size)
            sums += torch.stack((lm.detach(), gen.detach())).double()
        if self.world_size > 1:
            sums = self.fabric.all_reduce(sums, reduce_op="sum")
        clip = self.cfg.optim.grad_clip
        grad_norm = self.fabric.clip_gradients(self.model, self.optimizer, max_norm=clip if clip > 0 else float("inf"))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        if self.fabric.device.type == "cuda":
            torch.cuda.synchronize(self.fabric.device)
        lm_loss, gen_loss = sums.tolist()
        return StepResult(
            loss=lm_loss + weight * gen_loss,
            lm_loss=lm_loss,
            gen_loss=gen_loss,
            grad_norm=float(grad_norm),
            lr=lr,
            sequences=int(counts[2].item()),
            images=int(counts[3].item()),
            loss_tokens=int(counts[0].item()),
            data_wait_s=data_wait,
            step_time_s=time.perf_counter() - started,
        )

    # -------------------------------------------------------------------- loop
    def _metrics(self, result: StepResult, window: list[StepResult]) -> dict[str, float]:
        seconds = sum(r.step_time_s for r in window)
        sequences = sum(r.sequences for r in window)
        flops = sum(
            batch_flops(self.cfg.model, r.sequences, r.images, r.sequences if self.cfg.model.generator else 0)
            for r in window
        )
        metrics = {
            "train/loss": result.loss,
            "train/loss_avg": sum(r.loss for r in window) / len(window),
            "train/lm_loss": result.lm_loss,
            "train/lr": result.lr,
            "train/grad_norm": result.grad_norm,
            "perf/step_time_s": seconds / len(window),
            "perf/samples_per_s": sequences / seconds,
            "perf/tokens_per_s": sequences * self.cfg.model.seq_len / seconds,
            "perf/loss_tokens_per_s": sum(r.loss_tokens for r in window) / seconds,
            "perf/tflops_per_device": flops / seconds / self.world_size / 1e12,
            "perf/mfu": flops / seconds / (self.peak_flops * self.world_size),
            "perf/data_wait_fraction": sum(r.data_wait_s for r in window) / seconds,
            "perf/peak_memory_gib": peak_memory_gib(self.fabric.device),
            "data/skipped_samples": float(sum(self.loader.skipped.values())),
            "data/truncated_images": float(self.loader.truncated_images),
        }
        if self.cfg.model.generator is not None:
            metrics["train/gen_loss"] = result.gen_loss
        return metrics

    def fit(self) -> dict[str, float]:
        trainer = self.cfg.trainer
        stop_at = (
            trainer.max_steps if trainer.exit_after_step is None else min(trainer.max_steps, trainer.exit_after_step)
        )
        if self.rank == 0:
            log.info(
                "training %s for %d steps: %d process(es), %d microbatch(es) of %d per step per process",
                self.cfg.model.name,
                stop_at,
                self.world_size,
                self.accumulation,
                self.cfg.optim.micro_batch_size,
            )
        progress = tqdm(
            total=stop_at,
            initial=self.step,
            disable=self.rank != 0 or not trainer.progress_bar,
            desc="train",
            dynamic_ncols=True,
            mininterval=1.0,
        )
        window: list[StepResult] = []
        last_metrics: dict[str, float] = {}
        saved_at = self.step
        while self.step < stop_at:
            result = self.train_step()
            window.append(result)
            progress.update(1)
            progress.set_postfix(loss=f"{result.loss:.3f}", refresh=False)
            if self.step % trainer.log_every_n_steps == 0 or self.step == stop_at:
                last_metrics = self._metrics(result, window)
                self.metrics.log(self.step, last_metrics)
                if self.rank == 0:
                    progress.write(self._format(last_metrics))
                window = []
            every = trainer.checkpoint.every_n_steps
            if every and self.step % every == 0:
                self.save_checkpoint()
                saved_at = self.step
        if trainer.checkpoint.save_last and saved_at != self.step:
            self.save_checkpoint()
        self.checkpoints.wait()
        progress.close()
        self.metrics.close()
        return last_metrics

    def _format(self, m: dict[str, float]) -> str:
        gen = f" gen {m['train/gen_loss']:.3f}" if "train/gen_loss" in m else ""
        return (
            f"step {self.step:>6} | loss {m['train/loss']:.4f} (lm {m['train/lm_loss']:.3f}{gen}) | "
            f"lr {m['train/lr']:.2e} | grad {m['train/grad_norm']:.2f} | {m['perf/tokens_per_s']:,.0f} tok/s | "
            f"mfu {100 * m['perf/mfu']:.1f}% | data wait {100 * m['perf/data_wait_fraction']:.1f}% | "
            f"mem {m['perf/peak_memory_gib']:.2f} GiB"
        )


def describe(cfg: Config) -> str:
    return OmegaConf.to_yaml(cfg)
