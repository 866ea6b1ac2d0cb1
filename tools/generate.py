"""Text (and images) from a trained checkpoint, in one process (docs/EVALUATION.md).

    python tools/generate.py path=outputs/run prompt="a photo of a red"                 # greedy, 64 new tokens
    python tools/generate.py path=outputs/run prompt="drawing of" temperature=0.8 top_p=0.9 samples=4 seed=1
    python tools/generate.py path=outputs/run images=true prompt="photo of a red circle on blue" samples=4
    python tools/generate.py path=outputs/run prompt="a" cache=false                      # no KV cache (reference)

``path`` is a checkpoint, a ``checkpoints/`` directory or a run directory (its newest checkpoint); the model
and tokenizer are the run's (``<run>/config.yaml``), the weights are read by name whatever layout wrote them.
``prompt`` may hold several prompts separated by ``|``; each is continued ``samples`` times. Text: greedy at
``temperature=0`` (the default), else temperature and ``top_p`` (nucleus) sampling from ``seed``; a KV cache
(``cache=true``) makes each new token cost the same at any position (models/generation.py). Printed as one JSON
line per prompt and sample, with the seconds per new token. ``images=true``: the prompts are captions, the
generator samples ``steps`` DDIM (``sampler=ddim``) or DDPM-style (``sampler=ddpm``) steps conditioned on the
LLM's ``<gen>`` states, and a grid PNG is written to ``out`` (default ``<run>/samples/generate.png``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from disttrain_core.launch.cli import split_tool_args, tool_main
from disttrain_core.validation import ConfigError

OPTIONS = {
    "path": "",
    "prompt": "",
    "max_new_tokens": "64",
    "temperature": "0",
    "top_p": "1.0",
    "samples": "1",
    "seed": "0",
    "cache": "true",
    "images": "false",
    "steps": "25",
    "sampler": "ddim",
    "device": "cpu",
    "out": "",
}


def _flag(options: dict, key: str) -> bool:
    value = options[key].lower()
    if value not in ("true", "false"):
        raise ConfigError(f"{key}={options[key]!r}: use true or false")
    return value == "true"


def _number(options: dict, key: str, kind=int):
    try:
        return kind(options[key])
    except ValueError:
        raise ConfigError(f"{key}={options[key]!r}: give a {kind.__name__}") from None


def load_model(checkpoint: Path, device: str):
    """The run's model (its config.yaml) with the checkpoint's weights, in eval mode; the config; the
    tokenizer."""
    from omegaconf import OmegaConf

    from disttrain_core.config import typed_config
    from disttrain_core.data.tokenizer import tokenizer_for
    from disttrain_core.train.sampling import model_from_checkpoint

    config = checkpoint.parent.parent / "config.yaml"
    if not config.is_file():
        raise ConfigError(f"{checkpoint} has no run config.yaml beside its checkpoints/ ({config}): give a run's")
    cfg = typed_config(OmegaConf.to_container(OmegaConf.load(config), resolve=True))
    tokenizer = tokenizer_for(cfg)
    try:
        return model_from_checkpoint(checkpoint, cfg, tokenizer, device), cfg, tokenizer
    except ValueError as error:
        raise ConfigError(str(error)) from None


def main(argv: list[str]) -> int:
    import torch

    from disttrain_core.models.generation import Sampling, generate
    from disttrain_core.models.image_sampling import SAMPLERS
    from disttrain_core.train.checkpoint import read_meta, resume_candidates

    options, rest = split_tool_args(argv, OPTIONS)
    if rest:
        raise ConfigError(f"unknown option(s) {rest}; this tool takes {', '.join(sorted(OPTIONS))}")
    if not options["path"]:
        raise ConfigError("path=<checkpoint, checkpoints/ or run directory> is required")
    prompts = [p for p in options["prompt"].split("|")] if options["prompt"] else []
    if not prompts:
        raise ConfigError('prompt="..." is required (several: separated by |)')
    new_tokens, samples, seed = (_number(options, k) for k in ("max_new_tokens", "samples", "seed"))
    sampling = Sampling(_number(options, "temperature", float), _number(options, "top_p", float))
    try:
        sampling.check()
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if new_tokens < 1 or samples < 1:
        raise ConfigError(f"max_new_tokens={new_tokens} samples={samples}: each must be at least 1")
    if options["sampler"] not in SAMPLERS:
        raise ConfigError(f"sampler={options['sampler']!r}: use {' or '.join(SAMPLERS)}")
    device = options["device"]
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise ConfigError(f"device={device!r}: use cpu, or cuda on a machine with a GPU")
    try:
        checkpoint = resume_candidates(options["path"], ".")[0].resolve()
    except FileNotFoundError as error:
        raise ConfigError(str(error).replace("trainer.resume=", "path=")) from None
    model, cfg, tokenizer = load_model(checkpoint, device)
    step = int(read_meta(checkpoint)["step"])
    if _flag(options, "images"):
        return _images(model, cfg, tokenizer, prompts * samples, options, checkpoint, step)
    use_cache = _flag(options, "cache")
    if len(tokenizer.encode(max(prompts, key=len))) + 1 + new_tokens > cfg.model.seq_len:
        print(f"note: positions past model.seq_len={cfg.model.seq_len} were never trained on", file=sys.stderr)
    for index, prompt in enumerate(prompts):
        ids = torch.tensor([[tokenizer.bos_id, *tokenizer.encode(prompt)]] * samples, device=device)
        started = time.perf_counter()
        rows = generate(model.llm, ids, new_tokens, sampling, tokenizer.eos_id, seed + index, use_cache)
        seconds = time.perf_counter() - started
        produced = rows.shape[1] - ids.shape[1]
        for row in rows.tolist():
            text = tokenizer.decode([t for t in row[ids.shape[1] :] if t != tokenizer.eos_id])
            record = {"step": step, "prompt": prompt, "text": text, "new_tokens": produced}
            record["seconds_per_token"] = seconds / max(produced, 1)
            print(json.dumps(record), flush=True)
    return 0


def _images(model, cfg, tokenizer, captions: list[str], options: dict, checkpoint: Path, step: int) -> int:
    from PIL import Image

    from disttrain_core.models.image_sampling import generate_images, image_grid

    if cfg.model.generator is None:
        raise ConfigError(f"images=true: model {cfg.model.name} has no generator; drop images=true for text")
    try:
        images = generate_images(
            model, tokenizer, captions, _number(options, "steps"), options["sampler"], _number(options, "seed")
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    out = Path(options["out"] or checkpoint.parent.parent / "samples" / "generate.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image_grid(images).numpy()).save(out)
    print(json.dumps({"step": step, "captions": captions, "png": str(out)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
