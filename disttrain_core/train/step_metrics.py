"""What the training loop logs at a logging step: the window's metrics and the console line. A mixin of
:class:`~disttrain_core.train.loop.Trainer`, whose attributes it reads."""

from __future__ import annotations

from ..models.flops import batch_flops
from .perf import peak_memory_gib
from .results import StepValues


class StepMetrics:
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
        if self.replica_group is not None:  # trainer.fault_tolerance: the groups that took part in the last step
            metrics["fault_tolerance/groups"] = float(self.replica_group.participants)
        metrics = self.engine.whole_run_metrics(metrics)  # local SGD: counts of one worker -> of all
        metrics.update(self.engine.window_metrics(seconds, len(window)))  # HotSPa: switching, per-bucket times
        if self.timelines is not None and self.timelines.last.get("step") == self.step:
            metrics["perf/pipeline_measured_s"] = self.timelines.last["measured_s"]
            metrics["perf/pipeline_predicted_s"] = self.timelines.last["predicted_s"]
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
