"""Where a Trainer's samples come from (train/loop.py): the shard stream and the sample encoder, and the loader
of each data path -- a data producer, packed text, a token file, or decoding in this process's own workers."""

from __future__ import annotations

from ..config import Config
from ..data.blend import open_stream
from ..data.loader import MicrobatchLoader
from ..data.samples import SampleEncoder


def build_stream(cfg: Config, dp_rank: int, dp: int, global_stream: bool, tokenizer):
    """(stream, encoder): the shard stream this process reads (None where batches are built per step: packed
    text, token files) and the encoder that turns its samples into tensors."""
    trainer = cfg.trainer
    per_step = cfg.data.packing.enabled or cfg.data.format == "tokens"
    if per_step:
        stream = None  # built per step (data/packed_loader.py, data/token_file.py)
    elif global_stream:  # every process reads the one canonical stream and keeps its own samples
        stream = open_stream(cfg.data, trainer.seed)
    else:  # one stream per data-parallel replica, shards split by replica
        stream = open_stream(cfg.data, trainer.seed, dp_rank, dp)
    encoder = SampleEncoder(
        cfg.model,
        tokenizer,
        trainer.seed,
        cfg.data.max_image_pixels,
        video_frames=cfg.data.video_frames,
        chat_template=cfg.data.chat_template,
    )
    return stream, encoder


def build_loader(trainer, data_state: dict | None):
    """The loader of ``trainer``'s data path, positioned at ``data_state`` (a resumed run's, or None)."""
    cfg = trainer.cfg
    if trainer.producer:
        from ..data.producer import ProducerLoader, resolve_key, trainer_layout
        from ..data.producer_client import pool_addresses
        from ..models.flops import flops_per_item

        rows = sum(u.pp for u in trainer.layout.units)
        layout = trainer_layout(
            cfg, trainer.layout, trainer.accumulation, trainer.slot_samples, rows, flops_per_item(cfg.model)
        )
        addresses = pool_addresses(cfg.data.producer.address)
        start = {**(data_state or {}), "step": trainer.step}
        timeout, limit = float(cfg.data.producer.timeout_s), int(cfg.data.producer.max_frame_mb) << 20
        if len(addresses) > 1:
            from ..data.producer_client import ProducerPool, pool_connections

            share = _share(trainer)
            blocks = [
                (unit.block(r, trainer.slot_samples), unit.size // unit.dp)
                for unit in trainer.layout.units
                for r in range(unit.dp)
            ]
            connections = pool_connections(len(addresses), layout, share["block"], blocks)
            return ProducerPool(
                addresses, resolve_key(cfg), layout, start, timeout, limit, connections, share["fields"]
            )
        return ProducerLoader(addresses[0], resolve_key(cfg), layout, start, timeout, limit, **_share(trainer))
    if trainer.packing:
        from ..data.packed_loader import packed_loader

        return packed_loader(cfg, data_state)
    if trainer.token_file:
        from ..data.token_file import token_loader

        return token_loader(cfg, trainer.slot_samples, trainer.accumulation, data_state)
    return MicrobatchLoader(  # decoding inside this process's data workers
        trainer.stream,
        trainer.encoder,
        trainer.slot_samples if trainer.global_stream else cfg.optim.micro_batch_size,
        trainer.accumulation,
        num_workers=cfg.data.num_workers,
        prefetch_steps=cfg.data.prefetch_steps,
        worker_nice=cfg.data.worker_nice,
        state=data_state,
    )


def _share(trainer) -> dict:
    """What this process asks its producer for (data.producer.per_rank): its unit replica's block of every slot,
    and only the fields its stages read."""
    if not trainer.cfg.data.producer.per_rank:
        return {}
    return {"block": trainer.unit.block(trainer.dp_rank, trainer.slot_samples), "fields": trainer.engine.batch_fields()}


def describe_run(trainer) -> str:
    """The processes, layout, schedule and batch of a run, for its first log line."""
    layout = trainer.engine.describe() if trainer.cfg.parallel.mode == "hotspa" else trainer.layout.describe()
    if trainer.schedule is not None:
        layout += f" schedule={trainer.schedule.name} stages={trainer.schedule.num_stages}"
    if trainer.packing:
        from ..data.packed_loader import describe

        batch = describe(trainer.cfg)
    else:
        batch = f"{trainer.accumulation} microbatch(es) of {trainer.cfg.optim.micro_batch_size} per step per replica"
    return f"{trainer.world_size} process(es) ({layout}), {batch}"
