"""Samples to look at during training: every ``trainer.sample_every_n_steps`` steps and after the last, rank 0
continues each of ``trainer.samples.prompts`` with the LLM (models/generation.py: KV cache, greedy or
temperature/top-p) and, for a model with a generator, draws an image per caption of
``trainer.samples.captions`` (models/image_sampling.py). Written to ``<run>/samples/step_<N>.json`` (and
``.png``, a grid) and to every tracker (TensorBoard: ``samples/text`` and ``samples/images``).

Where rank 0 holds the whole model (the layouts the DDP engine trains) it samples from it in place. Elsewhere
(FSDP2, TP, PP, several units, HotSPa, local SGD) the model is spread over the ranks, so rank 0 samples from the
checkpoint saved at that step, read whole onto the host into a model of its own (validation/sampling.py asks
for a checkpoint at every sampling step); the ranks wait for that save to finish first. Sampling leaves
training as it was: eval mode under ``no_grad`` for its duration, its own seeded generators (no global random
state is drawn), blocks run eagerly (no compiled graph is added), and the training losses with and without it
are bit-equal (tests/distributed/test_sampling.py).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from ..models.generation import Sampling, generate
from ..models.image_sampling import DECODABLE, generate_images, image_grid


def sample_images(cfg) -> bool:
    """Whether samples include images: ``trainer.samples.images`` (null: when the model has a generator whose
    latents decode to pixels: ``pixel`` or ``sd_vae``)."""
    images = cfg.trainer.samples.images
    if images is None:
        return cfg.model.generator is not None and cfg.model.latent_encoder in DECODABLE
    return bool(images)


def samples_in_place(cfg, layout) -> bool:
    """Whether rank 0 holds the whole model to sample from (else: the checkpoint of the sampling step)."""
    return layout.trains_with_ddp() and cfg.parallel.mode not in ("hotspa", "local_sgd")


def model_from_checkpoint(checkpoint: Path, cfg, tokenizer, device: str | torch.device = "cpu"):
    """``cfg``'s model with the checkpoint's weights (read whole, by name, whatever layout wrote them), in eval
    mode; ValueError naming the first missing or unexpected tensor."""
    from ..models import build_model
    from .checkpoint import read_tensors

    model = build_model(cfg.model, tokenizer, device="meta")
    model.to_empty(device=device)
    for module in model.modules():  # buffers that are computed, not saved (rotary tables, the noise schedule)
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    missing, unexpected = model.load_state_dict(read_tensors(checkpoint), strict=False)
    if missing or unexpected:
        raise ValueError(f"{checkpoint} does not hold this model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()


class Samples:
    """Mixed into the Trainer (train/loop.py), whose attributes it reads."""

    @property
    def in_place(self) -> bool:
        return samples_in_place(self.cfg, self.layout)

    def samples_due(self, step: int) -> bool:
        every = self.cfg.trainer.sample_every_n_steps
        return every > 0 and (step % every == 0 or step == self.stop_at)

    def samples_after_save(self) -> None:
        """A sampling step of a spread-out model: every rank waits for the checkpoint just saved (a collective),
        then rank 0 samples from it."""
        if self.in_place or not self.samples_due(self.step):
            return
        self.checkpoints.wait()
        self.write_samples()

    def write_samples(self) -> dict[str, float]:
        """Samples of the model as it is now, written by rank 0 (the others go on); {"samples/seconds": s}."""
        if self.rank != 0:
            return {}
        started = time.perf_counter()
        if self.in_place:
            model, device = self.engine.raw_model, self.fabric.device
        else:  # the checkpoint just saved at this step (the trainer waited for it)
            from .checkpoint import latest_checkpoint

            model, device = (
                model_from_checkpoint(latest_checkpoint(self.checkpoints.root), self.cfg, self.tokenizer),
                "cpu",
            )
        training = model.training
        model.eval()
        autocast = self.fabric.autocast() if device == self.fabric.device else contextlib.nullcontext()
        try:
            with torch.no_grad(), torch.compiler.set_stance("force_eager"), autocast:
                texts = self._texts(model, device)
                images = self._images(model)
        finally:
            model.train(training)
        record = _write(self.run_dir / "samples", self.step, texts, images, self.cfg.trainer.samples.captions)
        self.metrics.log_text("samples/text", record["markdown"], self.step)
        if images is not None:
            self.metrics.log_image("samples/images", record["grid"], self.step)
        return {"samples/seconds": time.perf_counter() - started}

    def _texts(self, model, device) -> list[dict[str, str]]:
        s, tok = self.cfg.trainer.samples, self.tokenizer
        sampling = Sampling(float(s.temperature), float(s.top_p))
        out = []
        for index, prompt in enumerate(s.prompts):
            ids = torch.tensor([[tok.bos_id, *tok.encode(prompt)]], device=device)
            rows = generate(model.llm, ids, int(s.max_new_tokens), sampling, tok.eos_id, int(s.seed) + index)
            continuation = [t for t in rows[0, ids.shape[1] :].tolist() if t != tok.eos_id]
            out.append({"prompt": prompt, "text": tok.decode(continuation)})
        return out

    def _images(self, model) -> torch.Tensor | None:
        s = self.cfg.trainer.samples
        if not sample_images(self.cfg) or not s.captions:
            return None
        return generate_images(model, self.tokenizer, list(s.captions), int(s.steps), str(s.sampler), int(s.seed))


def _write(folder: Path, step: int, texts: list[dict], images: torch.Tensor | None, captions) -> dict:
    """``step_<N>.json`` (and ``.png``) in ``folder``; the markdown of the texts and the grid (HWC) for trackers."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    record: dict = {"step": step, "texts": texts}
    grid = None
    if images is not None:
        grid = image_grid(images).numpy()
        Image.fromarray(grid).save(folder / f"{name}.png")
        record.update(captions=list(captions), png=f"{name}.png")
    (folder / f"{name}.json").write_text(json.dumps(record, indent=1))
    lines = [f"**{t['prompt']}**{t['text']}" for t in texts]
    if images is not None:
        lines.append("images, left to right: " + "; ".join(captions))
    return {"markdown": "\n\n".join(lines), "grid": grid}
