"""Samples to look at during training: every ``trainer.sample_every_n_steps`` steps and after the last, rank 0
continues each of ``trainer.samples.prompts`` with the LLM (models/generation.py: KV cache, greedy or
temperature/top-p) and, for a model with a generator, draws an image per caption of
``trainer.samples.captions`` (models/image_sampling.py). Written to ``<run>/samples/step_<N>.json`` (and
``.png``, a grid) and to every tracker (TensorBoard: ``samples/text`` and ``samples/images``).

Rank 0's model is the whole model in the layouts the DDP engine trains (validation/sampling.py refuses the
others before launch). Sampling leaves training as it was: eval mode under ``no_grad`` for its duration, its
own seeded generators (no global random state is drawn), blocks run eagerly (no compiled graph is added), and
the training losses with and without it are bit-equal (tests/distributed/test_sampling.py).
"""

from __future__ import annotations

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


class Samples:
    """Mixed into the Trainer (train/loop.py), whose attributes it reads."""

    def samples_due(self, step: int) -> bool:
        every = self.cfg.trainer.sample_every_n_steps
        return every > 0 and (step % every == 0 or step == self.stop_at)

    def write_samples(self) -> dict[str, float]:
        """Samples of the model as it is now, written by rank 0 (the others go on); {"samples/seconds": s}."""
        if self.rank != 0:
            return {}
        started = time.perf_counter()
        model = self.engine.raw_model
        training = model.training
        model.eval()
        try:
            with torch.no_grad(), torch.compiler.set_stance("force_eager"), self.fabric.autocast():
                texts = self._texts(model)
                images = self._images(model)
        finally:
            model.train(training)
        record = _write(self.run_dir / "samples", self.step, texts, images, self.cfg.trainer.samples.captions)
        self.metrics.log_text("samples/text", record["markdown"], self.step)
        if images is not None:
            self.metrics.log_image("samples/images", record["grid"], self.step)
        return {"samples/seconds": time.perf_counter() - started}

    def _texts(self, model) -> list[dict[str, str]]:
        s, tok = self.cfg.trainer.samples, self.tokenizer
        sampling = Sampling(float(s.temperature), float(s.top_p))
        out = []
        for index, prompt in enumerate(s.prompts):
            ids = torch.tensor([[tok.bos_id, *tok.encode(prompt)]], device=self.fabric.device)
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
