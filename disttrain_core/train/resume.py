"""The trainer's checkpoint side: what it saves, and resuming from the newest usable checkpoint
(docs/CHECKPOINTS.md). A mixin of :class:`~disttrain_core.train.loop.Trainer`, kept apart so the loop
stays about steps."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..data.reader import shard_sample_counts
from .checkpoint import OK, check_model, read_json, read_meta, resume_candidates
from .data_position import carry
from .dcp_io import CheckpointCorrupt
from .optim import restore_scheduler

log = logging.getLogger(__name__)


class CheckpointIO:
    def _data_file(self) -> str:
        return "data_global.json" if self.global_stream else f"data_dp{self.dp_rank:05d}.json"

    def _resume(self) -> dict | None:
        """Load the newest usable checkpoint ``trainer.resume`` names; returns this rank's data position."""
        tried = []
        for checkpoint in resume_candidates(self.cfg.trainer.resume, self.job_dir):
            try:
                return self._load_checkpoint(checkpoint)
            except CheckpointCorrupt as error:
                tried.append(f"{checkpoint.name} ({error})")
                if self.rank == 0:
                    log.warning("checkpoint %s skipped: %s", checkpoint, error)
        if tried:
            raise CheckpointCorrupt(
                f"trainer.resume={self.cfg.trainer.resume}: no usable checkpoint ({'; '.join(tried)}); "
                "start fresh with trainer.resume=none"
            )
        initial = self.cfg.trainer.checkpoint.initial_load
        if self.cfg.trainer.resume == "auto" and self.rank == 0:
            log.info("trainer.resume=auto: no checkpoint in %s yet; starting from step 0", self.job_dir)
        if initial:
            self._initial_load(str(initial))
        return None

    def _initial_load(self, source: str) -> None:
        """trainer.checkpoint.initial_load: the model's weights from another run's newest usable checkpoint (its
        model entries only), at step 0 with a fresh optimizer and data position."""
        tried = []
        for checkpoint in resume_candidates(source, self.job_dir):
            try:
                meta = read_meta(checkpoint)
            except CheckpointCorrupt as error:
                tried.append(f"{checkpoint.name} ({error})")
                continue
            check_model(checkpoint, meta, self.cfg.model.name, self.fingerprint)
            state = self.engine.checkpoint_state(saving=False)
            weights = {key: value for key, value in state.items() if key.startswith("model.")}
            try:
                self.checkpoints.load(checkpoint, weights, meta)
            except CheckpointCorrupt as error:
                tried.append(f"{checkpoint.name} ({error})")
                continue
            self.engine.checkpoint_loaded([key for key in state if key not in weights])  # fresh optimizer state
            if self.rank == 0:
                log.info(
                    "trainer.checkpoint.initial_load: model weights from %s (its step %s); this run starts at step 0 "
                    "with a fresh optimizer and data position",
                    checkpoint,
                    meta.get("step"),
                )
            return
        raise CheckpointCorrupt(f"trainer.checkpoint.initial_load={source}: no usable checkpoint ({'; '.join(tried)})")

    def _load_checkpoint(self, checkpoint: Path) -> dict:
        problem, meta, saved_data, step = None, {}, [], 0
        try:
            meta = read_meta(checkpoint)
            data = meta.get("data", {})
            names = (
                ["data_global.json"]
                if data.get("stream") == "global"
                else [f"data_dp{r:05d}.json" for r in range(int(data.get("replicas", 1)))]
            )
            saved_data = [read_json(checkpoint, name, meta) for name in names]
            step = int(read_json(checkpoint, "trainer.json", meta)["step"])
            for position in saved_data:  # packed text and token files stand at a step; a shard stream at (epoch, index)
                int(position["step"]) if self.stream is None else (int(position["epoch"]), int(position["index"]))
        except CheckpointCorrupt as error:
            problem = str(error)
        except (KeyError, TypeError, ValueError, AttributeError) as error:  # well-formed JSON, wrong content
            problem = f"damaged state file ({type(error).__name__}: {error})"
        if self.checkpoints.agree(problem) != OK:
            raise CheckpointCorrupt(problem or "another rank found a damaged file")
        check_model(checkpoint, meta, self.cfg.model.name, self.fingerprint)
        absent = self.checkpoints.load(checkpoint, self.engine.checkpoint_state(saving=False), meta)
        self.engine.checkpoint_loaded(absent)
        if absent and self.rank == 0:
            log.warning(
                "checkpoint %s has no optimizer state for %d tensor(s) (e.g. %s; frozen when saved): they start "
                "from zero moments",
                checkpoint.name,
                len(absent),
                absent[0],
            )
        self.step = self.engine.resumed_step(step)  # A-EDiT: each worker's own step at the saving sync
        restore_scheduler(self.scheduler, self.step)
        superseded = self.checkpoints.supersede_after(step)
        if self.rank == 0:
            log.info("resumed from %s at step %d (saved by layout %s)", checkpoint, step, meta.get("layout"))
            if superseded:
                log.warning(
                    "this run continues from step %d: newer checkpoint(s) %s renamed *.superseded (kept, not resumed)",
                    step,
                    ", ".join(superseded),
                )
        replicas = 1 if self.global_stream else self.layout.llm.dp
        counts = None
        if len(saved_data) != replicas and not self.cfg.data.blend:  # a blend's positions carry over approximately
            try:
                counting = getattr(self.stream, "sample_counts", None)  # data.format=hf: rows as one-row shards
                counts = counting() if counting else shard_sample_counts(self.stream.shards)
            except Exception as error:  # an unreadable shard (the stream skips it): no exact mapping
                log.warning("could not count the samples per shard (%s)", error)
        carried = carry(saved_data, replicas, counts)
        if carried.message and self.rank == 0:
            (log.info if carried.exact else log.warning)(carried.message)
        return carried.states[0 if self.global_stream else self.dp_rank]

    def save_checkpoint(self, best: float | None = None) -> None:
        """``best``: the val/loss this checkpoint is kept for (trainer.checkpoint.keep_best)."""
        files: dict = {}
        state = self.engine.checkpoint_state(saving=True)
        owns_data = (
            self.rank == 0
            if self.global_stream
            else (self.pp_rank == 0 and self.unit.inner_index(self.rank) == 0 and self.unit.name == "llm")
        )
        if owns_data:
            files[self._data_file()] = self.loader.state_dict()
        named = self.engine.checkpoint_step(self.step)  # the same on every rank (A-EDiT: worker 0's step)
        if self.rank == 0:
            files["trainer.json"] = {"step": named}
        meta = {
            "data": {
                "stream": "global" if self.global_stream else "per_replica",
                "replicas": 1 if self.global_stream else self.layout.llm.dp,
            },
            "layout": self.layout.describe(),
            "model": {"name": self.cfg.model.name, "fingerprint": self.fingerprint},
            "torch": torch.__version__,
        }
        if best is not None:
            meta["best"] = {"val_loss": best}
        self.checkpoints.save(named, state, files, meta)
