"""Checks of the model, optimizer, trainer, device, data and cluster settings that relate several values
(single-setting bounds: ``numbers``; the shards of ``data.path``: ``data``)."""

from __future__ import annotations

import functools
import os

from omegaconf import OmegaConf

from ..config import Config, cpu_count, determinism, image_tokens
from .cluster_fit import launches_elsewhere
from .common import (
    ConfigError,
    _require,
    check_references,
    externally_launched,
    resolve_accelerator,
    resolve_backend,
)
from .data import (
    FORMATS,
    check_blend,
    check_chat_template,
    check_shards,
    check_token_file,
    check_val,
    check_val_kind,
    check_val_tokens,
    check_validation_run,
)
from .llm_family import validate_llm_shape
from .modalities import validate_audio, validate_synthetic_modalities
from .numbers import check_bounds
from .producer import check_pool_settings
from .projectors import validate_projectors


def _tokenizer(cfg: Config):
    """The tokenizer ``data.tokenizer`` names (loads its file: cheap); its errors become ConfigError."""
    name = str(cfg.data.tokenizer)
    try:
        stamp = os.stat(name).st_mtime_ns
    except OSError:
        stamp = None
    try:
        return _load_tokenizer(name, stamp, cfg.model.audio_encoder is not None, cfg.model.video_encoder is not None)
    except ValueError as error:
        raise ConfigError(str(error)) from None


@functools.lru_cache(maxsize=4)
def _load_tokenizer(name: str, stamp: int | None, audio: bool, video: bool):  # stamp: the file's mtime
    from ..data.tokenizer import build_tokenizer

    return build_tokenizer(name, audio, video)  # with the run's added tokens, as the run builds it


def validate_model(cfg: Config) -> None:
    check_references(cfg)  # validate_config runs this check first: every ${...} resolves,
    check_bounds(cfg)  # and every single setting is within its bounds, before anything divides by one
    m = cfg.model
    _require(m.family in ("mllm", "llama"), f"model.family={m.family!r}: allowed values are 'mllm' and 'llama'")
    llm = m.llm
    validate_llm_shape(cfg)
    _require(m.seq_len >= 8, f"model.seq_len={m.seq_len}: use at least 8 tokens")
    from ..models.document_attention import KERNELS

    _require(
        m.document_attention in KERNELS,
        f"model.document_attention={m.document_attention!r}: allowed values are {', '.join(KERNELS)}",
    )
    _require(
        m.loss_chunk >= 0,
        f"model.loss_chunk={m.loss_chunk}: use 0 (the head's logits whole) or a number of positions, e.g. 1024",
    )
    vocab = _tokenizer(cfg).vocab_size
    _require(
        llm.vocab_size >= vocab,
        f"model.llm.vocab_size={llm.vocab_size} is smaller than the {vocab} ids of "
        f"data.tokenizer={cfg.data.tokenizer}; set model.llm.vocab_size={vocab} (or more)",
    )
    validate_audio(cfg)
    validate_synthetic_modalities(cfg)
    if m.family == "llama":
        _require(
            m.encoder is None and m.generator is None,
            f"model.family=llama (model.name={m.name}) takes no encoder or generator; add model.family=mllm to "
            "train one, or drop them with ~model/encoder ~model/generator",
        )
        return
    need = "model.family=mllm needs an encoder; choose one (model/encoder=vit_tiny; conf/model/encoder lists them)"
    _require(m.encoder is not None, f"{need} or pick a multimodal model such as model=mllm_tiny")
    vit = m.encoder
    _require(
        vit.image_size % vit.patch_size == 0,
        f"model.encoder.image_size={vit.image_size} is not divisible by patch_size={vit.patch_size}",
    )
    _require(
        vit.dim % vit.n_heads == 0,
        f"model.encoder.dim={vit.dim} is not divisible by model.encoder.n_heads={vit.n_heads}",
    )
    from ..models.common import ACTIVATIONS
    from ..models.vit import vit_block_count

    _require(
        vit.activation in ACTIVATIONS,
        f"model.encoder.activation={vit.activation!r} is not known; set model.encoder.activation to one of "
        f"{sorted(ACTIVATIONS)} (quick_gelu for OpenAI CLIP weights)",
    )
    try:
        vit_block_count(vit)  # feature_layer within range
    except ValueError as error:
        raise ConfigError(str(error)) from None
    validate_projectors(cfg)
    tokens, gen_tokens = image_tokens(m), m.gen_tokens if m.generator is not None else 0
    resampled = m.encoder_projector.kind == "resampler"
    _require(
        m.seq_len >= tokens + gen_tokens + 3,
        f"model.seq_len={m.seq_len} cannot hold one image ({tokens} {'resampler' if resampled else 'patch'} tokens) "
        f"plus {gen_tokens} generation tokens; raise model.seq_len or lower "
        + ("model.encoder_projector.num_queries" if resampled else "model.encoder.image_size"),
    )
    if m.generator is not None:
        _validate_generator(cfg)


def _validate_generator(cfg: Config) -> None:
    m, unet = cfg.model, cfg.model.generator
    _require(
        len(unet.block_out_channels) == len(unet.cross_attention_blocks),
        f"model.generator.cross_attention_blocks has {len(unet.cross_attention_blocks)} entries but "
        f"block_out_channels has {len(unet.block_out_channels)}; give one per level",
    )
    from ..models.unet import level_head_dims

    try:
        head_dims = level_head_dims(unet)
    except ValueError as error:
        raise ConfigError(f"model.{error}") from None
    for channels, head_dim in zip(unet.block_out_channels, head_dims, strict=True):
        _require(
            channels % unet.norm_groups == 0,
            f"model.generator channel count {channels} is not divisible by norm_groups={unet.norm_groups}",
        )
        _require(
            channels % head_dim == 0,
            f"model.generator channel count {channels} is not divisible by head_dim={head_dim}",
        )
    _require(m.gen_tokens >= 1, f"model.gen_tokens={m.gen_tokens}: use at least 1 generation token")
    _require(
        m.gen_image_size % m.latent_downsample == 0,
        f"model.gen_image_size={m.gen_image_size} is not divisible by latent_downsample={m.latent_downsample}",
    )
    side = m.gen_image_size // m.latent_downsample
    factor = 2 ** (len(unet.block_out_channels) - 1)
    _require(
        side % factor == 0,
        f"latent side {side} (gen_image_size / latent_downsample) must be divisible by {factor} for "
        f"{len(unet.block_out_channels)} U-Net levels; change model.gen_image_size",
    )
    from ..models.latents import latent_encoder_names

    _require(
        m.latent_encoder in latent_encoder_names(),
        f"model.latent_encoder={m.latent_encoder!r} is not registered; available: {latent_encoder_names()}",
    )


def validate_optim(cfg: Config, dp: int = 1) -> None:
    """``dp``: the LLM unit's data-parallel size in the resolved layout (1 before the planner chose one)."""
    o = cfg.optim  # single-setting bounds (lr, eps, steps, batch sizes): numbers.check_bounds
    _require(
        len(o.betas) == 2 and all(0.0 <= b < 1.0 for b in o.betas),
        f"optim.betas={list(o.betas)}: give two values in [0, 1), e.g. [0.9,0.95]",
    )
    if cfg.data.packing.enabled:  # a step is data.packing.documents_per_step documents, packed into rows
        return
    _require(
        o.global_batch_size % (o.micro_batch_size * dp) == 0,
        f"optim.global_batch_size={o.global_batch_size} is not divisible by optim.micro_batch_size="
        f"{o.micro_batch_size} x data-parallel size {dp}; make it a multiple of {o.micro_batch_size * dp}",
    )


def validate_trainer(cfg: Config) -> None:
    t = cfg.trainer  # single-setting bounds (choices, counts, steps, timeouts): numbers.check_bounds
    check_validation_run(cfg)
    _require(
        0 <= t.memory_report_step <= t.max_steps,
        f"trainer.memory_report_step={t.memory_report_step}: use 0 (off) or a step from 1 to trainer.max_steps "
        f"({t.max_steps})",
    )
    world = t.devices * t.num_nodes
    slow = [r for r in t.straggler.ranks if r >= world]
    _require(
        not slow,
        f"trainer.straggler.ranks: {slow[0] if slow else ''} is not a rank of this job (0..{world - 1}); "
        "name ranks below trainer.devices x trainer.num_nodes",
    )
    _require(
        not t.straggler.ranks or t.threads_per_rank == 1,
        f"trainer.straggler multiplies the training thread's CPU time, which is the step's compute only with one "
        f"torch thread (trainer.threads_per_rank={t.threads_per_rank}): set trainer.threads_per_rank=1",
    )
    accelerator = resolve_accelerator(t.accelerator)
    _require(
        not (t.straggler.ranks and accelerator == "cuda"),
        "trainer.straggler emulates a slow process with busy work on its host thread, timed by the host's CPU "
        "clock: on CUDA it would delay the launches, not the device; unset trainer.straggler.ranks",
    )
    # a dry run or a submission to a scheduler starts no rank here: this machine's devices do not matter
    elsewhere = externally_launched() or launches_elsewhere(cfg)
    if accelerator == "cuda":
        import torch

        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        _require(
            available > 0 or elsewhere,
            "trainer.accelerator=cuda but this machine has no CUDA device; use trainer.accelerator=cpu (or "
            "trainer.dry_run=true to plan a GPU run here)",
        )
        _require(
            t.devices <= available or elsewhere,
            f"trainer.devices={t.devices} but this node has {available} CUDA device(s); lower trainer.devices",
        )
    else:
        _require(t.backend != "nccl", "trainer.backend=nccl needs CUDA devices; use trainer.backend=gloo on CPU")
        per_core, cores = t.cpu_processes_per_core, cpu_count()
        _require(per_core >= 1, f"trainer.cpu_processes_per_core={per_core} must be at least 1")
        _require(
            t.devices <= per_core * cores,
            f"trainer.devices={t.devices} CPU processes exceeds {per_core * cores} ({per_core} per core x {cores} "
            f"cores); lower trainer.devices, or raise trainer.cpu_processes_per_core if you mean it",
        )
    if t.num_nodes > 1 and not elsewhere:
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if v not in os.environ]
        _require(
            not missing,
            f"trainer.num_nodes={t.num_nodes} needs {', '.join(missing)} in the environment of "
            "every node (or launch with torchrun/srun)",
        )
    _require(
        t.resume in ("none", "auto") or os.path.exists(t.resume),
        f"trainer.resume={t.resume!r}: use none, auto, or an existing checkpoint or run directory",
    )


def validate_device_contract(cfg: Config) -> None:
    """Settings that cannot work on the accelerator the run will use, found before any device is touched
    (so they are reported the same way on a laptop planning a GPU job)."""
    t, comm = cfg.trainer, cfg.parallel.comm
    _require(
        t.deterministic in ("auto", "warn", True, False),
        f"trainer.deterministic={t.deterministic!r}: allowed values are auto, true, false and warn",
    )
    from ..train.host_sync import MODES

    _require(t.sync_debug in MODES, f"trainer.sync_debug={t.sync_debug!r}: allowed values are {', '.join(MODES)}")
    _require(
        t.start_method in ("forkserver", "spawn"),
        f"trainer.start_method={t.start_method!r}: allowed values are forkserver and spawn",
    )
    _require(
        comm.wire_dtype in ("auto", "fp32", "bf16"),
        f"parallel.comm.wire_dtype={comm.wire_dtype!r}: allowed values are auto, fp32 and bf16",
    )
    accelerator = resolve_accelerator(t.accelerator)
    backend = resolve_backend(t.backend, accelerator)
    _require(
        not (comm.collectives == "ring" and backend == "nccl"),
        "parallel.comm.collectives=ring drives gloo point-to-point rings from a CPU thread; NCCL runs its own "
        "rings on a communication stream: use parallel.comm.collectives=auto (or native) with NCCL",
    )
    _require(
        not (cfg.model.document_attention == "flex" and accelerator != "cuda"),
        f"model.document_attention=flex trains on CUDA only (torch {torch_version()} has no FlexAttention backward "
        f"on {accelerator}); use model.document_attention=varlen (or auto)",
    )
    if accelerator == "cuda" and determinism(t.deterministic, accelerator) is True:
        from ..models.kernels import nondeterministic_cuda_ops

        found = nondeterministic_cuda_ops(cfg.model)
        _require(
            not found,
            f"trainer.deterministic=true on CUDA, but the model's training step uses {', '.join(found)}, which "
            "has no deterministic CUDA kernel and would fail at its first call; use trainer.deterministic=warn "
            "(run it anyway, with a warning) or false",
        )


def torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def validate_data(cfg: Config, dp: int = 1) -> None:
    """``dp``: how many replicas split the shards (1 where every process reads the one global stream, or
    before the planner chose a layout)."""
    d = cfg.data
    _tokenizer(cfg)  # a name it knows, a readable tokenizer.json or a tiktoken file
    _require(d.num_workers >= 0, f"data.num_workers={d.num_workers}: use 0 (decode inline) or more")
    _require(0 <= d.worker_nice <= 19, f"data.worker_nice={d.worker_nice}: use 0 (off) to 19")
    p = d.producer
    _require(p.workers >= 0, f"data.producer.workers={p.workers}: use 0 (decode in the trainers) or more")
    _require(p.timeout_s > 0, f"data.producer.timeout_s={p.timeout_s}: use a positive number of seconds")
    _require(p.prefetch_steps >= 1, f"data.producer.prefetch_steps={p.prefetch_steps}: use 1 or more")
    _require(p.max_frame_mb >= 1, f"data.producer.max_frame_mb={p.max_frame_mb}: use 1 or more (MiB)")
    _require(
        1 <= p.max_connections <= 65536,
        f"data.producer.max_connections={p.max_connections}: use 1 to 65536 (each is a thread of the producer)",
    )
    _require(
        p.handshake_timeout_s > 0,
        f"data.producer.handshake_timeout_s={p.handshake_timeout_s}: use a positive number of seconds",
    )
    from ..data.producer_client import pool_addresses

    _require(
        p.address is None or isinstance(p.address, str) or OmegaConf.is_list(p.address) or isinstance(p.address, list),
        f"data.producer.address={p.address!r}: use HOST:PORT, or a pool's list [HOST1:PORT1,HOST2:PORT2]",
    )
    addresses = pool_addresses(p.address)
    for name, value in [("address", a) for a in addresses] + [("listen", p.listen)]:
        host, sep, port = str(value).rpartition(":")
        _require(
            bool(sep and host and port.isdigit() and int(port) < 65536),
            f"data.producer.{name}={value!r}: use HOST:PORT, e.g. 127.0.0.1:7070"
            + (" (a pool: data.producer.address=[HOST1:PORT1,HOST2:PORT2])" if name == "address" else ""),
        )
    _require(p.address is None or bool(addresses), f"data.producer.address={p.address!r}: name at least one HOST:PORT")
    check_pool_settings(p, addresses)
    _require(d.prefetch_steps >= 1, f"data.prefetch_steps={d.prefetch_steps}: use 1 or more")
    _require(d.max_image_pixels >= 1, f"data.max_image_pixels={d.max_image_pixels}: use a positive pixel count")
    _require(d.format in FORMATS, f"data.format={d.format!r}: allowed values are {', '.join(FORMATS)}")
    check_val_kind(cfg)
    check_chat_template(cfg)
    if d.blend:
        _require(
            d.format in ("webdataset", "hf") and not d.packing.enabled,
            "data.blend mixes shard or data=hf sources; it does not apply to data.format=tokens or data.packing: "
            "drop data.blend",
        )
    if d.blend and d.format == "webdataset":
        check_blend(cfg, dp)
        check_val(cfg, dp)
        return
    if d.format == "hf":  # rows of parquet / arrow / jsonl files (data/hf_source.py), or a blend of them
        from .hf_data import check_hf

        return check_hf(cfg)
    if d.format == "tokens":  # one pre-tokenized file: no shards are read
        check_token_file(cfg)
        check_val_tokens(cfg)
        return
    if d.packing.enabled:  # documents are built per step: no shards are read
        from .packing import validate_packing

        validate_packing(cfg)
        return
    shard_count = check_shards(cfg)  # none, missing ones, or generation into a path it should not write
    _require(
        shard_count >= dp,
        f"data.path={d.path!r} has {shard_count} shard(s) for {dp} data-parallel ranks; every rank needs at "
        "least one shard: split the data into more shards or use fewer processes",
    )
    check_val(cfg, dp)


def validate_planner(cfg: Config) -> None:
    from ..parallel.recompute import POLICIES

    p = cfg.planner
    allowed = ("auto", *POLICIES)
    _require(p.recompute in allowed, f"planner.recompute={p.recompute!r}: allowed values are {', '.join(allowed)}")
    _require(p.recompute_every >= 1, f"planner.recompute_every={p.recompute_every}: use 1 or more")
    shards = ("zero1", "zero2", "zero3", "auto")
    _require(
        p.shard in shards,
        f"planner.shard={p.shard!r}: allowed values are {', '.join(shards)} (plans run as units, which shard at "
        "least zero1)",
    )
    comm = cfg.parallel.comm  # the share the plan hides is hidden by the runtime's overlap, or not at all
    _require(
        p.dp_overlap == 0 or comm.overlap_grad_reduce or comm.overlap_param_gather,
        f"planner.dp_overlap={p.dp_overlap} assumes overlapped ZeRO traffic, but parallel.comm.overlap_grad_reduce "
        "and parallel.comm.overlap_param_gather are both false: set planner.dp_overlap=0 or switch overlap on",
    )


def validate_cluster(cfg: Config) -> None:
    c = cfg.cluster  # single-setting bounds (device, sizes, bandwidths, efficiency): numbers.check_bounds
    _require(
        c.runtime_overhead_gb < c.memory_per_device_gb,
        f"cluster.runtime_overhead_gb={c.runtime_overhead_gb} leaves no memory of cluster.memory_per_device_gb="
        f"{c.memory_per_device_gb} for training; lower the overhead or raise the device memory",
    )
