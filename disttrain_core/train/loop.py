"""The training loop: data -> engine (forward/backward) -> optimizer ->
checkpoint -> metrics.

Loss normalization is global: before the microbatches of a step run, the
data-parallel replicas agree (one all-reduce) on the number of loss tokens and
generation targets in the whole global batch, and every microbatch divides its
summed losses by those totals. The accumulated gradient is then exactly the
gradient of the global-batch mean loss, whatever the number of processes,
pipeline stages and microbatches -- which is what makes parallel layouts
reproduce a single process. (Local SGD after its warm-up is the exception: each
worker normalizes by its own tokens, train/local_sgd/engine.py.)
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from lightning_fabric import Fabric
from omegaconf import OmegaConf
from tqdm import tqdm

from ..base.clock import DeviceClock
from ..base.faults import inject
from ..comm.engine import interleaved_mode
from ..config import training_precision
from ..data.tokenizer import tokenizer_for
from ..models import build_model
from ..models.flops import batch_flops, document_flops, llm_flop_terms
from ..parallel.compile import CompileWatch
from ..parallel.resolved import ResolvedRun
from .checkpoint import CheckpointManager
from .engines import build_engine
from .evaluation import Evaluation
from .host_sync import HostSyncGuard
from .inputs import build_loader, build_stream, describe_run
from .memory_report import MemoryReport, allocation_peak
from .metrics import MetricsLogger
from .optim import build_scheduler
from .perf import peak_flops_per_device, peak_memory_gib
from .results import StepResult, StepValues, read_results
from .resume import CheckpointIO
from .sampling import Samples
from .state import model_fingerprint
from .step_data import StepData
from .stop import StopRequest
from .straggler import Straggler
from .timeline_report import TimelineReporter

log = logging.getLogger(__name__)


def _dump_flight(reason: str) -> None:
    from ..comm import flight

    flight.dump(reason)


class Trainer(StepData, CheckpointIO, Evaluation, Samples):
    def __init__(self, run: ResolvedRun, fabric: Fabric, run_dir: str | Path, stop_request: StopRequest | None = None):
        """``run``: the launcher's resolved run (parallel/resolved.py): its config and layout."""
        cfg = run.cfg
        self.run = run
        self.cfg = cfg
        self.fabric = fabric
        self.run_dir = Path(run_dir)
        self.rank = fabric.global_rank
        self.world_size = fabric.world_size
        trainer, optim = cfg.trainer, cfg.optim
        self.layout = run.layout
        self.unit = self.layout.unit_of(self.rank)
        self.dp_rank, self.tp_rank, self.pp_rank = self.unit.coords(self.rank)
        llm = self.layout.llm
        # A microbatch slot carries every LLM replica's micro-batch; several units share it by sample blocks.
        self.slot_samples = optim.micro_batch_size * llm.dp
        self.accumulation = optim.global_batch_size // self.slot_samples
        # Several units, or a data producer: every process gets the whole (reordered) global batch and
        # keeps its unit replica's block of each slot.
        self.producer = cfg.data.producer.address is not None
        # Packed text (data.packing): every process builds the whole step and takes its share.
        self.packing = cfg.data.packing.enabled
        self._packed_flops = 0.0  # model FLOPs of the packed steps since the last log
        # counted once, not per step, and only where metrics are written (rank 0)
        self._flop_terms = llm_flop_terms(cfg.model) if self.packing and self.rank == 0 else None
        self.token_file = cfg.data.format == "tokens"  # pre-tokenized windows, positioned by step like packing
        self.global_stream = len(self.layout.units) > 1 or self.producer or self.packing or self.token_file
        self.audio_data = not (self.packing or self.token_file)  # samples that may carry audio members
        self.tokenizer = tokenizer_for(cfg)
        timeout = timedelta(seconds=trainer.dist_timeout_s)
        self.engine, self.count_group, self.schedule, self.broker = build_engine(
            run, fabric, self.tokenizer, self.accumulation, self.global_stream, timeout
        )
        self.optimizer = self.engine.build_optimizer()
        self.scheduler = build_scheduler(getattr(self.optimizer, "inner", self.optimizer), optim, trainer.max_steps)

        self.stream, self.encoder = build_stream(cfg, self.dp_rank, llm.dp, self.global_stream, self.tokenizer)
        self.fingerprint = model_fingerprint(build_model(cfg.model, self.tokenizer, device="meta"))
        # Checkpoint collectives (DCP planning, in a background thread when saving asynchronously) run on a
        # group of their own, on the host (docs/COMM.md): never queued behind or between training's.
        group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        # The stop flag (train/stop.py) is reduced on a host-side group of its own, after every step.
        control = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        self.stop_request = stop_request or StopRequest(float(trainer.stop_grace_s), on_signal=_dump_flight)
        self.stop_request.attach(control)
        self.engine.stop_request = self.stop_request
        self.straggler = Straggler(trainer.straggler, self.rank)
        self.compile_watch = CompileWatch(self.rank) if trainer.compile else None  # graph breaks, recompiles
        self.checkpoints = CheckpointManager(
            self.run_dir / "checkpoints",
            rank=self.rank,
            world_size=self.world_size,
            barrier=fabric.barrier,
            keep_last=trainer.checkpoint.keep_last,
            async_save=trainer.checkpoint.async_save,
            process_group=group,
        )
        self.step = 0
        data_state = self._resume()
        self.loader = build_loader(self, data_state)
        self._build_reporting()

    def _build_reporting(self) -> None:
        """Metrics, pipeline timelines, the device clock and host-sync guard, the memory report, MFU's peak."""
        cfg, trainer, fabric = self.cfg, self.cfg.trainer, self.fabric
        config = OmegaConf.to_container(cfg, resolve=True) if self.rank == 0 else None
        self.metrics = MetricsLogger(self.run_dir, self.rank == 0, cfg.logger, config)
        self.timelines = None
        if trainer.record_timeline and self.schedule is not None:
            first_pipeline = [places[0][0].rank(0, 0, places[0][1]) for places in self.broker.row_places]
            self.timelines = TimelineReporter(
                self.run_dir, self.rank, first_pipeline, self.schedule, fabric.barrier, self.metrics
            )
        stop = trainer.exit_after_step
        self.stop_at = trainer.max_steps if stop is None else min(trainer.max_steps, stop)
        self.clock = DeviceClock(fabric.device)
        self.sync_guard = HostSyncGuard(trainer.sync_debug, fabric.device)
        self.memory_report = None
        if trainer.memory_report_step:
            self.memory_report = MemoryReport(cfg, self.run_dir, self.rank, self.unit, self.pp_rank)
        self.peak_flops = peak_flops_per_device(
            training_precision(cfg.trainer.precision, fabric.device.type),
            fabric.device,
            cfg.cluster.peak_flops_bf16,
            cfg.cluster.peak_flops_fp32,
            cfg.cluster.peak_flops_tf32,
            cfg.trainer.tf32,
        )

    # --------------------------------------------------------------------- step
    def train_step(self) -> StepResult:
        """One optimizer step. Nothing is read back from the device here (see train/host_sync.py)."""
        inject("step", self.rank, self.step + 1)  # fault drills (disttrain_core/base/faults.py); off by default
        started = self.clock.stamp()
        host_started = time.perf_counter()
        self.straggler.start()
        comm = self.cfg.parallel.comm
        if comm.interleave_modes:
            self.engine.set_comm_mode(interleaved_mode(comm.interleave_modes, comm.interleave_block, self.step + 1))
        trace = getattr(self.engine, "trace", None)
        microbatches = self.loader.next_step()
        data_wait = time.perf_counter() - host_started
        if self._flop_terms is not None:  # the model's FLOPs of this step's documents (read at the next log)
            self._packed_flops += document_flops(self._flop_terms, self.loader.last_lengths)
        if trace is not None:
            trace.compute("data", host_started, time.perf_counter())
        counts = self._global_counts(microbatches, trace)
        microbatches = self._local_microbatches(microbatches)
        step = self.step + 1
        trainer = self.cfg.trainer
        record = self.timelines is not None and self.timelines.wants(step, trainer.log_every_n_steps, self.stop_at)
        if record:
            self.fabric.barrier()  # a common origin for every rank's timestamps
        report = self.memory_report if self.memory_report is not None and step == self.memory_report.step else None
        peak: dict = {}
        if report is not None:
            report.start_of_step(self.engine, self.optimizer)
        with (
            self.sync_guard.check(self._checks_host_syncs(step)),
            allocation_peak(peak, self.fabric.device) if report is not None else nullcontext(),
        ):
            result = self.engine.forward_backward(microbatches, counts, record=record)
            self.engine.after_backward()
            clip = self.cfg.optim.grad_clip
            clipping = trace.now() if trace is not None else None
            grad_norm = self.engine.clip_gradients(clip if clip > 0 else float("inf"))
            if trace is not None:
                trace.compute("clip (norm all-reduce)", clipping, trace.now())
            lr = self.optimizer.param_groups[0]["lr"]
            self.optimizer.step()
            if report is not None:
                report.after_optimizer_step(self.engine, self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.straggler.delay(step)  # trainer.straggler: an emulated slow process (benchmarks)
            self.engine.after_step()
            moe = self.engine.moe_stats()
            result.resolve()
            ended = self.clock.stamp()
        self.step = step
        if report is not None:
            report.write(peak)
        if trace is not None:
            trace.step(self.step, started, ended)
        if record:  # drawing the timeline is not training time: the step ended above
            self.timelines.report(self.step, result.timeline)
        return StepResult(
            sums=result.sums,
            counts=counts.reduced(),
            grad_norm=grad_norm,
            lr=lr,
            data_wait_s=data_wait,
            started=started,
            ended=ended,
            moe=moe,
        )

    def _logs(self, step: int) -> bool:
        """A logging step: every log_every_n_steps, the last, and every validation or sampling step (its record
        holds both)."""
        every = self.cfg.trainer.log_every_n_steps
        return step % every == 0 or step == self.stop_at or self.validation_due(step) or self.samples_due(step)

    def _checks_host_syncs(self, step: int) -> bool:
        """trainer.sync_debug checks this step: not the first, a logging or a checkpoint step (timelines are
        recorded at logging steps), not a step the engine reads host values in by design (local SGD's sync
        steps with the penalty, A-EDiT's steps), and not while the communication trace (which anchors its clock)
        is on."""
        every = self.cfg.trainer.checkpoint.every_n_steps
        checkpoint = bool(every) and step % every == 0
        skipped = self._logs(step) or checkpoint or self.engine.host_reads(step) or self.cfg.parallel.comm.trace
        return step > 1 and not skipped

    # --------------------------------------------------------------------- loop
    def _window_flops(self, sequences: int, window: list[StepValues]) -> float | None:
        """The window's training FLOPs where metrics are written, else None (a first count costs a core-second).
        batch_flops is linear in the amounts: one call per window (each call's cache key, ~8 ms, showed on a GPU)."""
        packed, self._packed_flops = self._packed_flops, 0.0
        if not self.metrics.enabled or self.packing:  # packed: documents, attention inside each (models/flops.py)
            return packed if self.metrics.enabled else None
        images, clips = sum(r.images for r in window), sum(r.clips for r in window)
        m = self.cfg.model
        gens = (sequences if m.generator else 0, clips, sequences if m.audio_generator else 0)  # every row runs them
        return batch_flops(m, sequences, images, *gens, video_groups=sum(r.groups for r in window))

    def _metrics(self, result: StepValues, window: list[StepValues]) -> dict[str, float]:
        seconds = sum(r.step_time_s for r in window)
        sequences = sum(r.sequences for r in window)
        flops = self._window_flops(sequences, window)
        metrics = {
            "train/loss": result.loss,
            "train/loss_avg": sum(r.loss for r in window) / len(window),
            "train/lm_loss": result.lm_loss,
            "train/lr": result.lr,
            "train/grad_norm": result.grad_norm,
            "perf/step_time_s": seconds / len(window),
            "perf/samples_per_s": sequences / seconds,
            # packed rows: the tokens that carry a label (documents, not padding)
            "perf/tokens_per_s": (
                sum(r.loss_tokens for r in window) if self.packing else sequences * self.cfg.model.seq_len
            )
            / seconds,
            "perf/loss_tokens_per_s": sum(r.loss_tokens for r in window) / seconds,
            "perf/data_wait_fraction": sum(r.data_wait_s for r in window) / seconds,
            "perf/peak_memory_gib": peak_memory_gib(self.fabric.device),
            "data/skipped_samples": float(sum(self.loader.skipped.values())),
            "data/truncated_images": float(self.loader.truncated_images),
        }
        if flops is not None:
            metrics["perf/tflops_per_device"] = flops / seconds / self.world_size / 1e12
            metrics["perf/mfu"] = flops / seconds / (self.peak_flops * self.world_size)
        dropped_audio = self.loader.state_dict().get("truncated_audio", 0) if self.audio_data else 0
        if dropped_audio or self.cfg.model.audio_encoder is not None:  # clips cut (or, without an audio tower, all)
            metrics["data/truncated_audio"] = float(dropped_audio)
        if self.cfg.data.blend and self.stream is not None:  # each source's share of the samples read so far
            index = int(self.loader.state_dict().get("index", 0))
            metrics.update({f"data/blend/{name}": share for name, share in self.stream.shares(index).items()})
        if self.producer:  # what this process received of the last step (data.producer.per_rank: its share)
            metrics["data/producer_bytes_per_step"] = float(self.loader.bytes_received)
        if self.cfg.model.generator is not None:
            metrics["train/gen_loss"] = result.gen_loss
        metrics = self.engine.whole_run_metrics(metrics)  # local SGD: counts of one worker -> of all
        metrics.update(self.engine.window_metrics(seconds, len(window)))  # HotSPa: switching, per-bucket times
        if self.timelines is not None and self.timelines.last.get("step") == self.step:
            metrics["perf/pipeline_measured_s"] = self.timelines.last["measured_s"]
            metrics["perf/pipeline_predicted_s"] = self.timelines.last["predicted_s"]
        return metrics

    def fit(self) -> dict[str, float]:
        trainer = self.cfg.trainer
        stop_at = self.stop_at
        skipping = self.cfg.parallel.comm.skip_collectives or "compute_only" in self.cfg.parallel.comm.interleave_modes
        if self.rank == 0 and skipping and self.world_size > 1:
            log.warning(
                "parallel.comm: collectives are skipped (compute only): gradients are not reduced; for timing only"
            )
        if trainer.eval_only:  # tools/evaluate.py: the resumed model on data.val, nothing trained
            return self._evaluate_only()
        if self.rank == 0:
            log.info("training %s for %d steps: %s", self.cfg.model.name, stop_at, describe_run(self))
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
        best = self.best_so_far() if trainer.checkpoint.keep_best else None
        weight = self.cfg.model.gen_loss_weight
        while self.engine.keep_going(self.step, stop_at):
            improved = None  # the val/loss of a new best model (trainer.checkpoint.keep_best)
            window.append(self.train_step())
            progress.update(1)
            if self.compile_watch is not None:
                self.compile_watch.after_step(self.step)
            if self._logs(self.step):  # the only place step results are read back from the device
                values = read_results(window, weight)
                last_metrics = self._metrics(values[-1], values)
                if window[-1].moe is not None:
                    dropped, load = window[-1].moe.tolist()
                    last_metrics.update({"moe/dropped_assignments": dropped, "moe/max_load_ratio": load})
                if self.sync_guard.enabled:
                    last_metrics.update(self.sync_guard.summary())
                if self.compile_watch is not None:
                    last_metrics.update(self.compile_watch.metrics())
                if self.validation_due(self.step):
                    last_metrics.update(self.validate())
                    if best is not None and last_metrics["val/loss"] < best:
                        best = improved = last_metrics["val/loss"]
                if self.samples_due(self.step) and self.in_place:
                    last_metrics.update(self.write_samples())
                self.metrics.log(self.step, last_metrics)
                progress.set_postfix(loss=f"{values[-1].loss:.3f}", refresh=False)
                if self.rank == 0:
                    progress.write(self._format(last_metrics))
                window = []
            every = trainer.checkpoint.every_n_steps
            if self.engine.checkpoint_due(self.step, every) or improved is not None:
                self.save_checkpoint(improved)
                saved_at = self.step
                self.samples_after_save()
            if self.engine.stop_agreed(self.stop_request):
                last_metrics = {**last_metrics, "stopped_at_step": float(self.step)}
                if self.rank == 0:
                    progress.write(
                        f"stopping at step {self.step} ({self.stop_request.signal_name or 'signal'} on a rank): "
                        "checkpoint, then exit; trainer.resume=auto continues from here"
                    )
                if saved_at != self.step:
                    self.save_checkpoint()
                    saved_at = self.step
                break
        if trainer.checkpoint.save_last and saved_at != self.step:
            self.save_checkpoint()
            self.samples_after_save()
        self._finish()
        progress.close()
        return last_metrics

    def _finish(self) -> None:
        """After the last step: the communication trace, the pending save, the engine and the trackers closed."""
        self.engine.synchronize()
        trace = getattr(self.engine, "trace", None)
        if trace is not None:
            trace.dump(self.run_dir / "comm_trace" / f"rank{self.rank:05d}.json")
        self.checkpoints.wait()
        self.stop_request.close()
        self.engine.close()
        self.metrics.close()

    def _evaluate_only(self) -> dict[str, float]:
        metrics = self.validate()
        self.metrics.log(self.step, metrics)
        if self.rank == 0:
            log.info(
                "step %d: val/loss %.6f (val/lm_loss %.6f)", self.step, metrics["val/loss"], metrics["val/lm_loss"]
            )
        self.checkpoints.wait()
        self.stop_request.close()
        self.engine.close()
        self.metrics.close()
        return metrics

    def _format(self, m: dict[str, float]) -> str:
        gen = f" gen {m['train/gen_loss']:.3f}" if "train/gen_loss" in m else ""
        val = f" | val {m['val/loss']:.4f} (ppl {m['val/ppl']:.2f})" if "val/loss" in m else ""
        return (
            f"step {self.step:>6} | loss {m['train/loss']:.4f} (lm {m['train/lm_loss']:.3f}{gen}) | "
            f"lr {m['train/lr']:.2e} | grad {m['train/grad_norm']:.2f} | {m['perf/tokens_per_s']:,.0f} tok/s | "
            f"mfu {100 * m['perf/mfu']:.1f}% | data wait {100 * m['perf/data_wait_fraction']:.1f}% | "
            f"mem {m['perf/peak_memory_gib']:.2f} GiB{val}"
        )
