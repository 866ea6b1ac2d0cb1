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

from ..base import faults
from ..base.clock import DeviceClock
from ..comm.engine import interleaved_mode
from ..config import training_precision
from ..config.parallel import reads_whole_steps
from ..data.tokenizer import tokenizer_for
from ..models import build_model
from ..models.flops import document_flops, llm_flop_terms
from ..parallel.compile import CompileWatch
from ..parallel.resolved import ResolvedRun
from .checkpoint import CheckpointManager
from .engines import build_engine
from .evaluation import Evaluation
from .fault_tolerance.replica import start_count
from .host_sync import HostSyncGuard
from .inputs import build_loader, build_stream, describe_run
from .memory_report import MemoryReport, allocation_peak
from .metrics import MetricsLogger
from .optim import build_scheduler
from .perf import peak_flops_per_device
from .results import StepResult, read_results
from .resume import CheckpointIO
from .sampling import Samples
from .state import model_fingerprint
from .step_data import StepData
from .step_metrics import StepMetrics
from .stop import StopRequest
from .straggler import Straggler
from .timeline_report import TimelineReporter

log = logging.getLogger(__name__)


def _dump_flight(reason: str) -> None:
    from ..comm import flight

    flight.dump(reason)


class Trainer(StepData, StepMetrics, CheckpointIO, Evaluation, Samples):
    def __init__(
        self,
        run: ResolvedRun,
        fabric: Fabric,
        run_dir: str | Path,
        stop_request: StopRequest | None = None,
        job_dir: str | Path | None = None,
    ):
        """``run``: the launcher's resolved run (parallel/resolved.py): its config and layout. ``job_dir``: where
        checkpoints live when it is not ``run_dir`` (a replica group of a fault-tolerant job writes its logs and
        metrics under the job's directory, its checkpoints into the job's own)."""
        cfg = run.cfg
        self.run = run
        self.cfg = cfg
        self.fabric = fabric
        self.run_dir = Path(run_dir)
        self.job_dir = Path(job_dir) if job_dir is not None else self.run_dir
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
        # trainer.fault_tolerance: the replica groups of a quorum split each whole step between them
        self.fault_tolerant = cfg.trainer.fault_tolerance.enabled
        self.global_stream = (
            len(self.layout.units) > 1
            or self.producer
            or self.packing
            or self.token_file
            or self.fault_tolerant
            or reads_whole_steps(cfg)  # every replica's item counts, without asking the others
        )
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
        self.checkpoints = self._checkpoint_manager(group)
        self.step = 0
        data_state = self._resume()
        self.loader = build_loader(self, data_state)
        self.replica_group = None
        if self.fault_tolerant:  # after the state it sends a joining group exists (train/fault_tolerance/)
            from .fault_tolerance.replica import ReplicaGroupMember

            self.replica_group = ReplicaGroupMember(self)
            faults.identify(self.replica_group.replica * self.world_size, start_count())
        faults.install_model_hooks(self.engine.called_modules(), self.rank, lambda: self.step + 1)
        self._build_reporting()

    def _checkpoint_manager(self, group) -> CheckpointManager:
        """Checkpoints of the job (``group``: the host-side group DCP plans on)."""
        trainer = self.cfg.trainer
        return CheckpointManager(
            self.job_dir / "checkpoints",
            rank=self.rank,
            world_size=self.world_size,
            barrier=self.fabric.barrier,
            keep_last=trainer.checkpoint.keep_last,
            async_save=trainer.checkpoint.async_save,
            process_group=group,
            # a replacement replica group: another group may be saving now
            clean_partials=not self.fault_tolerant or start_count() == 0,
        )

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
    def train_step(self) -> StepResult | None:
        """One optimizer step. Nothing is read back from the device here (see train/host_sync.py). None: a
        fault-tolerant job's quorum did not commit the step (a replica failed in it); it is taken again."""
        if self.replica_group is not None:  # this step's quorum; a joining group receives its state here
            self.replica_group.begin_step()
        # fault drills (base/faults.py), off by default; in a fault-tolerant job by job rank and the group's start
        faults.inject("step", self.rank, self.step + 1)
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
            if self.replica_group is not None and self.replica_group.per_step:  # over the quorum's groups, its vote
                params = self.engine.replica_gradients()
                result.sums = self.replica_group.reduce(params, result.resolve().sums)
                if not self.replica_group.commit():
                    self.optimizer.zero_grad(set_to_none=True)
                    return None
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

    def _saves_checkpoints(self) -> bool:
        """Whether this process takes part in saving: in a fault-tolerant job only the first group of the last
        quorum saves (the groups hold the same state), into the job's checkpoint directory."""
        return self.replica_group is None or self.replica_group.first_in_quorum()

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
            step_result = self.train_step()
            if step_result is None:  # not committed by the quorum: taken again
                continue
            window.append(step_result)
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
                if self.rank == 0 and self._saves_checkpoints():  # fault tolerance: one group's line, not each's
                    progress.write(self._format(last_metrics))
                window = []
            every = trainer.checkpoint.every_n_steps
            due = self.engine.checkpoint_due(self.step, every) or improved is not None
            if due and self._saves_checkpoints():
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
                if saved_at != self.step and self._saves_checkpoints():
                    self.save_checkpoint()
                    saved_at = self.step
                break
        if trainer.checkpoint.save_last and saved_at != self.step and self._saves_checkpoints():
            self.save_checkpoint()
            self.samples_after_save()
        self._finish()
        progress.close()
        return last_metrics

    def _finish(self) -> None:
        """After the last step: the communication trace, the pending save, the engine and the trackers closed."""
        self.engine.synchronize()
        if self.replica_group is not None:
            self.replica_group.finish(self.run_dir, self.engine.models())
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
