"""Validation during training: the loss on the held-out split (``data.val``) every ``trainer.val_every_n_steps``
steps and after the last step.

Every evaluation reads the same samples: the split's first ``trainer.val_batches`` global batches, in a fixed
order (data/splits.py ``open_val_stream``: no shuffling), decoded in this process (no worker; also when training
reads a data producer), or the first windows of a held-out token file, or the first packed steps of the held-out
documents (data/packed_loader.py ``held_out``; HotSPa runs each bucket in its strategy). Each process reads
the whole of each global batch, keeps its replica's block of every microbatch slot, as a training step of a
multi-unit layout does (train/step_data.py), and the engine runs forwards only (train/engine.py
``Engine.evaluate``: the DDP engine's model, or the schedule's forward actions with no gradient transfers, in
eval mode under ``torch.no_grad``). The loss sums are summed over the replicas; the token and generation-sample
counts come from the batches on the host, the same on every process.

With ``trainer.checkpoint.keep_best`` every evaluation that lowers ``val/loss`` below the best so far (read back
from the checkpoint ``<checkpoints>/best`` names, so it survives a resume) saves a checkpoint at that step, which
pruning never removes.

Logged: ``val/loss`` (LM loss plus ``model.gen_loss_weight`` times the denoising loss, as training's),
``val/lm_loss`` (mean over the held-out tokens), ``val/ppl`` (its exponential) and, with a generator,
``val/gen_loss``. Evaluation leaves training as it was: it draws no random numbers (the denoising noise is
seeded by the sample), touches no optimizer, data or MoE-balancing state, and the training losses with and
without it are bit-equal (tests/distributed/test_validation.py).
"""

from __future__ import annotations

import json
import math
import time

import torch

from ..data.loader import MicrobatchLoader
from ..data.splits import open_val_stream


class Evaluation:
    """Mixed into the Trainer (train/loop.py), whose attributes it reads."""

    def best_so_far(self) -> float:
        """The val/loss of the checkpoint ``<checkpoints>/best`` names (trainer.checkpoint.keep_best), or inf."""
        pointer = self.checkpoints.root / "best"
        meta = pointer.parent / (pointer.read_text().strip() if pointer.is_file() else "-") / "meta.json"
        return float(json.loads(meta.read_text())["best"]["val_loss"]) if meta.is_file() else math.inf

    def validation_due(self, step: int) -> bool:
        every = self.cfg.trainer.val_every_n_steps
        return every > 0 and (step % every == 0 or step == self.stop_at)

    def _val_loader(self):
        """The held-out split's loader, from its start: its shards in a fixed order, or its token file's windows
        in the order (seed, epoch 0) gives them."""
        cfg = self.cfg
        if self.packing:
            from ..data.packed_loader import packed_loader

            return packed_loader(cfg, None, held_out=True)
        if self.token_file:
            from ..data.token_file import TokenFileLoader

            m = cfg.model
            path, seed = cfg.data.val.path, cfg.trainer.seed
            return TokenFileLoader(path, m.seq_len, self.slot_samples, self.accumulation, m.llm.vocab_size, seed)
        stream = open_val_stream(cfg.data, cfg.trainer.seed)
        return MicrobatchLoader(stream, self.encoder, self.slot_samples, self.accumulation)

    def validate(self) -> dict[str, float]:
        """The held-out loss of the model as it is now (a collective: every process calls it)."""
        started = time.perf_counter()
        cfg = self.cfg
        loader = self._val_loader()
        self.engine.synchronize()  # parameter gathers still in flight from the last optimizer step
        sums = torch.zeros(2, dtype=torch.float64, device=self.fabric.device)
        tokens = samples = 0.0
        hotspa = self.packing and cfg.parallel.mode == "hotspa"  # HotSPa splits the buckets per strategy
        for _ in range(cfg.trainer.val_batches):
            microbatches = loader.next_step()  # the whole global batch: its counts are the same everywhere
            tokens += sum(mb.loss_tokens() for mb in microbatches)
            samples += sum(mb.gen_samples() for mb in microbatches)
            if self.broker is not None:
                self.broker.count_items(microbatches)
            local = (
                microbatches if hotspa else self._with_replica_items(self._replica_share(microbatches, self.dp_rank))
            )
            sums += self.engine.evaluate(local)
        lm_sum, gen_sum = sums.tolist()  # a host read, off the training steps
        lm = lm_sum / max(tokens, 1.0)
        metrics = {"val/lm_loss": lm, "val/ppl": math.exp(min(lm, 80.0))}
        loss = lm
        if cfg.model.generator is not None:
            metrics["val/gen_loss"] = gen_sum / max(samples, 1.0)
            loss += cfg.model.gen_loss_weight * metrics["val/gen_loss"]
        metrics["val/loss"] = loss
        metrics["val/seconds"] = time.perf_counter() - started
        metrics["val/skipped_samples"] = float(sum(loader.skipped.values()))
        return metrics
