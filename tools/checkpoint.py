"""Look into, verify and convert checkpoints (torch.distributed.checkpoint directories, train/checkpoint.py).

    python tools/checkpoint.py inspect path=outputs/run/checkpoints/step_00000300
    python tools/checkpoint.py verify path=outputs/run            # the newest checkpoint of a run
    python tools/checkpoint.py convert path=... to=safetensors out=model.safetensors
    python tools/checkpoint.py convert path=... to=torch out=model.pt
    python tools/checkpoint.py convert path=... to=hf_llama out=hf/   # Hugging Face LlamaForCausalLM

``path`` is a checkpoint directory, a ``checkpoints/`` directory or a run directory (its newest
checkpoint). ``inspect`` prints the step, layout, model, data positions and every tensor's shape;
``verify`` checks every file's size and SHA-256 against meta.json (exit 1 on a mismatch);
``convert`` writes the full model tensors (``model.*``, optimizer state left out) in one process:
safetensors or ``torch.save`` files keyed by parameter name, or -- for a text model -- the
Hugging Face Llama layout (config.json + model.safetensors) that ``LlamaForCausalLM.from_pretrained``
loads, using the run's config.yaml for the model's settings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from disttrain_core.launch.cli import split_tool_args, tool_main
from disttrain_core.validation import ConfigError

OPTIONS = {"path": "", "to": "safetensors", "out": "", "dtype": "float32"}


def _checkpoint(path: str) -> Path:
    from disttrain_core.train.checkpoint import candidates

    if not path:
        raise ConfigError("path=<checkpoint, checkpoints/ or run directory> is required")
    here = Path(path)
    if (here / "meta.json").is_file() or here.name.startswith("step_"):
        return here
    for root in (here, here / "checkpoints"):
        found = candidates(root)
        if found:
            return found[0]
    raise ConfigError(f"path={path}: no checkpoint there")


def inspect(checkpoint: Path) -> int:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from disttrain_core.train.checkpoint import read_meta
    from disttrain_core.train.dcp_io import VerifyingReader

    meta = read_meta(checkpoint)
    print(f"checkpoint {checkpoint}")
    print(f"  step {meta['step']}, written by {meta['world_size']} process(es), layout {meta.get('layout')}")
    model = meta.get("model", {})
    print(f"  model {model.get('name')} (fingerprint {model.get('fingerprint')}), torch {meta.get('torch')}")
    sizes = sum(r["size"] for r in meta["files"].values())
    print(f"  {len(meta['files'])} files, {sizes / 2**20:.2f} MiB; data: {json.dumps(meta.get('data'))}")
    metadata = VerifyingReader(checkpoint, meta["files"]).read_metadata()
    params = optim = 0
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if not isinstance(md, TensorStorageMetadata):
            continue
        if key.startswith("model."):
            params += md.size.numel()
            print(f"  {key[len('model.') :]:60s} {str(tuple(md.size)):18s} {str(md.properties.dtype)[6:]}")
        else:
            optim += md.size.numel()
    print(f"  {params:,} model elements, {optim:,} optimizer elements")
    return 0


def verify(checkpoint: Path) -> int:
    from disttrain_core.train.checkpoint import read_meta
    from disttrain_core.train.dcp_io import CheckpointCorrupt, check_file

    try:
        meta = read_meta(checkpoint)
    except CheckpointCorrupt as error:
        print(f"{checkpoint}: {error}")
        return 1
    bad = 0
    for name, record in sorted(meta["files"].items()):
        try:
            check_file(checkpoint / name, record)
        except CheckpointCorrupt as error:
            print(f"{checkpoint}: {error}")
            bad += 1
    print(f"{checkpoint}: {len(meta['files']) - bad} of {len(meta['files'])} files verified")
    return 1 if bad else 0


def convert(checkpoint: Path, options: dict) -> int:
    import torch

    from disttrain_core.train.checkpoint import read_tensors

    to, out = options["to"], options["out"]
    if to not in ("safetensors", "torch", "hf_llama") or not out:
        raise ConfigError(f"to={to!r} out={out!r}: use to=safetensors|torch|hf_llama and out=<path>")
    dtype = getattr(torch, options["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype={options['dtype']!r}: use float32, bfloat16 or float16")
    tensors = {name: t.to(dtype) for name, t in read_tensors(checkpoint).items()}
    if to == "torch":
        torch.save(tensors, out)
    elif to == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, out)
    else:
        from omegaconf import OmegaConf

        from disttrain_core.config import typed_config
        from disttrain_core.models.hf.llama import export_llama

        config = checkpoint.parent.parent / "config.yaml"
        if not config.is_file():
            raise ConfigError(f"to=hf_llama needs the run's config.yaml ({config} is missing)")
        cfg = typed_config(OmegaConf.to_container(OmegaConf.load(config), resolve=True))
        if cfg.model.encoder is not None or cfg.model.generator is not None:
            raise ConfigError(f"to=hf_llama exports a text model; {cfg.model.name} has an encoder or generator")
        llm = {k[len("llm.") :]: v for k, v in tensors.items() if k.startswith("llm.")}
        export_llama(llm, cfg.model.llm, out, dtype=dtype)
    print(f"wrote {len(tensors)} tensors ({sum(t.numel() for t in tensors.values()):,} elements) to {out}")
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("inspect", "verify", "convert"):
        print(__doc__)
        return 2
    options, rest = split_tool_args(argv[1:], OPTIONS)
    if rest:
        raise ConfigError(f"unknown option(s) {rest}; this tool takes {sorted(OPTIONS)}")
    checkpoint = _checkpoint(options["path"])
    if argv[0] == "inspect":
        return inspect(checkpoint)
    if argv[0] == "verify":
        return verify(checkpoint)
    return convert(checkpoint, options)


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
