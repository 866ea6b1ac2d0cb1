"""Pipeline stages of every unit, cut from outside the model code.

A stage is the whole model built on the meta device with everything it does not
own removed, so parameter names -- and therefore the seeded initialization -- are
exactly those of the single-process model. Each stage's ``forward(inbound, batch)``
returns what it sends to the next stage (if anything) and the loss sums it computes:

* encoder stages split the ViT blocks evenly; the first embeds the pixels, the last
  applies the output norm, projection and the encoder projector and sends one row of
  LLM-width embeddings per image patch group ``[images, P, D]``;
* LLM stages split the decoder layers evenly; the first embeds tokens and places the
  image embeddings (computed here when the encoder is colocated, received otherwise),
  the last computes the LM loss and either the generation loss (colocated generator)
  or sends the generation queries ``[samples, G, D]`` to the generator unit;
* the generator stage projects the queries and computes the denoising loss.

``splittable_backward`` says whether torch's input/weight backward split is exact
for the stage: only when every weight reaches the outputs through the stage input
(not when data -- pixels, tokens, noisy latents -- enters the stage directly).
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm.group_autograd import sum_gradient
from ..config import ModelConfig
from ..data.batch import Batch
from ..data.tokenizer import Tokenizer
from ..models import build_model
from ..models.llama import Documents
from ..models.mllm import MultimodalLLM
from ..models.vit import vit_block_count
from .context_parallel import SequenceSlices, scale_gradient
from .generator_stages import GeneratorStage
from .item_balance import encode_items
from .side_stages import (
    AUDIO_GENERATION,
    AUDIO_TARGET_FIELDS,
    AudioEncoderStage,
    AudioGeneratorStage,
    VideoEncoderStage,
)
from .stage_output import GENERATION_FIELDS, StageOutput
from .units import AUDIO_MODULES, ENCODER_MODULES, ENCODER_UNITS, GENERATOR_UNITS, VIDEO_MODULES


def split_evenly(count: int, parts: int, what: str) -> list[range]:
    if count % parts:
        raise ValueError(
            f"{what}={count} cannot be split evenly over {parts} pipeline stages; choose a stage count dividing it"
        )
    per = count // parts
    return [range(i * per, (i + 1) * per) for i in range(parts)]


def llm_block_ranges(blocks: int, count: int, split=None) -> list[range]:
    """The LLM blocks of each of ``count`` LLM pipeline stages: ``split``'s counts (parallel.pp_split), or an
    even split."""
    if split is None:
        return split_evenly(blocks, count, "model.llm.n_layers")
    if isinstance(split, str):
        raise ValueError(f"parallel.pp_split={split!r} reached the runtime unresolved (the launch resolves auto)")
    if len(split) != count or sum(split) != blocks or min(split) < 1:
        raise ValueError(f"parallel.pp_split={list(split)} does not split {blocks} blocks into {count} stages")
    ends = [sum(split[: i + 1]) for i in range(count)]
    return [range(end - int(n), end) for end, n in zip(ends, split, strict=True)]


def _drop(module: nn.Module, names: tuple[str, ...]) -> None:
    for name in names:
        setattr(module, name, None)


def _keep_blocks(blocks: nn.ModuleDict, keep: range) -> None:
    for key in list(blocks.keys()):
        if int(key) not in keep:
            del blocks[key]


def encoder_stage_fields(first: bool) -> tuple[str, ...]:
    """The Batch fields an encoder stage reads: the images in its first stage, none after."""
    return ("image_counts", "images") if first else ("image_counts",)


def llm_stage_fields(first: bool, last: bool, encoder: bool, generator: bool, sends_queries: bool) -> tuple[str, ...]:
    """The Batch fields an LLM stage reads (``batch_fields``; the data producer sends a trainer only those of its
    stages, data.producer.per_rank): token ids where it embeds them or finds the <gen> queries, images where it
    holds the encoder, labels and generation targets at the end. A middle stage reads none."""
    fields = ["image_counts"]
    if first:
        fields.append("tokens")
        if encoder:
            fields.append("images")
    if last:
        fields.append("labels")
        if generator or sends_queries:
            fields.append("tokens")
        if generator:
            fields.extend(GENERATION_FIELDS)
    return tuple(dict.fromkeys(fields))


class EncoderStage(nn.Module):
    kind = "encoder"

    def __init__(self, model: MultimodalLLM, index: int, count: int, split: tuple[int, ...] | None = None):
        super().__init__()
        self.is_first, self.is_last = index == 0, index == count - 1
        vit = model.encoder
        built = vit_block_count(vit.cfg)
        if split is None:  # ``split``: blocks per stage (schedule.fill_split), else even
            blocks = split_evenly(built, count, "model.encoder blocks built (n_layers, feature_layer)")
        else:
            blocks = [range(sum(split[:i]), sum(split[: i + 1])) for i in range(count)]
        _keep_blocks(vit.blocks, blocks[index])
        if not self.is_first:
            _drop(vit, ("patch_embed", "class_embedding", "positional_embedding", "norm_pre"))
        if not self.is_last:
            _drop(vit, ("norm_post", "proj"))
            model.encoder_projector = None
        _drop(model, ("llm", "generator_projector", "generator", "latent_encoder", *AUDIO_MODULES, *VIDEO_MODULES))
        _drop(model, AUDIO_GENERATION)
        self.model = model
        self.vit_row = (vit.tokens_per_image, vit.cfg.dim)
        self.splittable_backward = not self.is_first
        self.batch_fields = encoder_stage_fields(self.is_first)

    def forward(self, inbound: torch.Tensor | None, batch: Batch) -> StageOutput:
        if self.is_first and self.is_last:  # the whole tower: its images may be rebalanced over the replicas
            return StageOutput(encode_items(self, "image", self.model.encode_images, batch).flatten(0, 1))
        vit = self.model.encoder
        x = vit.embed(batch.images) if self.is_first else inbound
        x = vit.run_blocks(x)
        if self.is_last:  # one row per embedding token: the LLM's inbound sections share the row shape [D]
            x = self.model.encoder_projector(vit.head(x)).flatten(0, 1)
        return StageOutput(x)

    def inbound_row(self) -> tuple[int, ...] | None:
        return None if self.is_first else self.vit_row

    def outbound_row(self) -> tuple[int, ...]:
        return (self.model.cfg.llm.dim,) if self.is_last else self.vit_row


class LlmStage(nn.Module):
    kind = "llm"

    def __init__(
        self,
        model: MultimodalLLM,
        index: int,
        count: int,
        modules: tuple[str, ...],
        context: SequenceSlices | None = None,
        split=None,
    ):
        super().__init__()
        holds_encoder, holds_generator = "encoder" in modules, "generator" in modules
        self.is_first, self.is_last = index == 0, index == count - 1
        self.context = context  # context parallelism: this rank's slice of every sequence
        cfg = model.cfg
        _keep_blocks(model.llm.layers, llm_block_ranges(cfg.llm.n_layers, count, split)[index])
        if not self.is_first:
            model.llm.tok_embeddings = None
        if not (self.is_first and holds_encoder):
            _drop(model, ("encoder", "encoder_projector"))
        if not (self.is_first and "audio_encoder" in modules):
            _drop(model, AUDIO_MODULES)
        if not (self.is_first and "video_encoder" in modules):
            _drop(model, VIDEO_MODULES)
        if not self.is_last:
            model.llm.norm = model.llm.output = None
        if not (self.is_last and "audio_generator" in modules):
            _drop(model, AUDIO_GENERATION)
        if not (self.is_last and holds_generator):
            _drop(model, ("generator_projector", "generator", "latent_encoder"))
        self.model = model
        self.holds_encoder = holds_encoder

        # The encoder units feeding this stage (sections of its inbound tensor, in unit order) and the generator
        # units its generation queries go to (one copy each), parallel/broker.py.
        def separate(names: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(name for name in names if getattr(cfg, name) is not None and name not in modules)

        self.inbound_units = separate(ENCODER_UNITS) if self.is_first else ()
        self.outbound_units = separate(GENERATOR_UNITS) if self.is_last else ()
        self.inbound_sections = len(self.inbound_units) if self.inbound_units else None  # the executor splits
        self.sends_queries = bool(self.outbound_units)
        generates = model.generator is not None or model.audio_generator is not None
        data_fed = self.is_first or (self.is_last and generates)
        self.splittable_backward = not data_fed  # pixels, tokens or noisy latents enter the stage directly
        self.batch_fields = llm_stage_fields(
            self.is_first, self.is_last, model.encoder is not None, model.generator is not None, self.sends_queries
        )
        if model.audio_encoder is not None:
            self.batch_fields += ("audio_counts", "audio")
        if model.video_encoder is not None:
            self.batch_fields += ("video_counts", "video")
        if model.audio_generator is not None:
            self.batch_fields += ("tokens", *AUDIO_TARGET_FIELDS)

    def forward(self, inbound, batch: Batch) -> StageOutput:
        """``inbound``: the previous stage's hidden states; in the first stage, one embedding section per encoder
        unit (``inbound_units``; a tuple, [tokens, D] each), or None."""
        m, cp = self.model, self.context
        if self.is_first:
            received = {}
            for name, part in zip(self.inbound_units, inbound if inbound is not None else (), strict=True):
                if cp is not None:  # the encoder units hear one CP rank
                    part = sum_gradient(part, cp.group)
                received[name] = part.unsqueeze(0)  # embed_tokens fills the slots in order from any [n, P, D]
            image_embeds = audio_embeds = video_embeds = None
            if m.encoder is not None:  # colocated towers (their items may be rebalanced over the replicas)
                image_embeds = encode_items(self, "image", m.encode_images, batch)
            if m.audio_encoder is not None:
                audio_embeds = encode_items(self, "clip", m.encode_audio, batch)
            if m.video_encoder is not None:
                video_embeds = encode_items(self, "group", m.encode_video, batch)
            image_embeds = received.get("encoder", image_embeds)
            audio_embeds = received.get("audio_encoder", audio_embeds)
            video_embeds = received.get("video_encoder", video_embeds)
            hidden = m.embed_tokens(batch.tokens, image_embeds, audio_embeds, video_embeds)
            if cp is not None:
                hidden = cp.slice(hidden)
        else:
            hidden = inbound
        documents = None
        if batch.doc_ids is not None:  # packed documents: attention and positions stay inside each
            documents = Documents(batch.doc_ids, batch.positions)
            if cp is not None:
                documents = cp.documents(documents)
        hidden = m.llm.run_layers(hidden, documents)
        if not self.is_last:
            return StageOutput(hidden)
        hidden = m.llm.final_norm(hidden)
        labels = batch.labels if cp is None else cp.slice(batch.labels, fill=-100)
        sums = {"lm_loss_sum": m.lm_loss_sum(hidden, labels)}
        whole = hidden
        needs_queries = self.sends_queries or m.generator is not None or m.audio_generator is not None
        if cp is not None and needs_queries:
            whole = cp.gather(hidden)  # the <gen> positions are anywhere in the sequence
        queries = m.generation_queries(whole, batch.tokens) if needs_queries else None
        if m.generator is not None:  # colocated: every generator's loss (the audio one's too)
            sums["gen_loss_sum"] = m.generation_loss_from_queries(queries, batch)
        if m.audio_generator is not None:  # colocated here, whether the image generator is or not
            audio = m.audio_generation_loss_from_queries(queries, batch)
            sums["gen_loss_sum"] = sums["gen_loss_sum"] + audio if "gen_loss_sum" in sums else audio
        if cp is not None and "gen_loss_sum" in sums:  # every CP rank computes it; its gradients sum over them
            sums["gen_loss_sum"] = sums["gen_loss_sum"] / cp.size
        send = None
        if self.sends_queries:  # one copy per generator unit: their gradients sum in the cat's backward
            send = queries if len(self.outbound_units) == 1 else torch.cat([queries] * len(self.outbound_units))
        if send is not None and cp is not None:  # the gradient comes back to every CP rank: count it once
            send = scale_gradient(send, 1.0 / cp.size)
        return StageOutput(send, sums)

    def inbound_row(self) -> tuple[int, ...] | None:
        cfg = self.model.cfg
        if self.is_first:
            return (cfg.llm.dim,) if self.inbound_units else None
        return (self.sequence_rows(), cfg.llm.dim)

    def sequence_rows(self) -> int:
        """Positions of each sequence a stage boundary carries (a slice under context parallelism)."""
        return self.model.cfg.seq_len if self.context is None else self.context.local_len

    def outbound_row(self) -> tuple[int, ...] | None:
        cfg = self.model.cfg
        if not self.is_last:
            return (self.sequence_rows(), cfg.llm.dim)
        return (cfg.gen_tokens, cfg.llm.dim) if self.sends_queries else None


def fields_read(stages) -> tuple[str, ...] | None:
    """The Batch fields a rank's stages read, together (None: some stage does not say, so all of them)."""
    fields: dict[str, None] = {}
    for stage in stages:
        declared = getattr(stage, "batch_fields", None)
        if declared is None:
            return None
        fields.update(dict.fromkeys(declared))
    return tuple(fields)


def build_unit_stage(
    cfg: ModelConfig,
    tokenizer: Tokenizer,
    unit_name: str,
    modules: tuple[str, ...],
    index: int,
    count: int,
    context: SequenceSlices | None = None,
    split=None,
) -> nn.Module:
    """Stage ``index`` of ``count`` of a unit, on the meta device (materialize it afterwards); ``split``: the
    blocks per stage (None: even): parallel.pp_split for the LLM, schedule.fill_split's for the encoder's chunks."""
    model = build_model(cfg, tokenizer, device="meta")
    if unit_name == "encoder":
        return EncoderStage(model, index, count, split)
    if unit_name == "generator":
        return GeneratorStage(model, index, count)
    if unit_name == "audio_encoder":
        return AudioEncoderStage(model, index, count)
    if unit_name == "audio_generator":
        return AudioGeneratorStage(model, index, count)
    if unit_name == "video_encoder":
        return VideoEncoderStage(model, index, count)
    return LlmStage(model, index, count, modules, context, split)


def build_rank_stages(
    cfg: ModelConfig,
    tokenizer: Tokenizer,
    unit,
    schedule,
    unit_rows: list[int],
    row: int,
    device: torch.device,
    seed: int,
    tp_mesh=None,
    sequence_overlap: bool = False,
    sequence_parallel: bool = False,
    shard=None,
    context: SequenceSlices | None = None,
    experts=None,
    compile_blocks: bool = False,
    float8: str = "none",
    split=None,
    param_device: torch.device | None = None,
) -> dict[int, nn.Module]:
    """The materialized stage modules of one schedule row, keyed by schedule stage.

    Shard before materialize: the stage is cut and tensor-parallelized on the meta device, then only this
    rank's shards (and the replicated weights) get memory and their seeded values -- never the whole stage.
    ``param_device``: where the parameters are materialized when not on ``device`` (FSDP2 with CPU offload: the
    host), the buffers then moved to ``device``.
    """
    from ..models.common import init_weights
    from .compile import apply_compile
    from .context_parallel import apply_context_parallel
    from .expert_parallel import apply_expert_parallel
    from .float8 import apply_float8
    from .recompute import apply_recompute
    from .tensor_parallel import apply_tensor_parallel

    unit_stages = [s for s in range(schedule.num_stages) if schedule.stage_to_rank[s] in unit_rows]
    chunks = schedule.meta.get("encoder_stages", 0)  # schedule.fill_bubbles: the encoder's chunks, then the LLM's
    stages = {}
    for stage in schedule.stages_of(row):
        index = unit_stages.index(stage)
        if index < chunks:
            blocks = schedule.meta["encoder_split"]
            module = build_unit_stage(cfg, tokenizer, "encoder", ENCODER_MODULES, index, chunks, split=blocks)
        else:
            modules = tuple(name for name in unit.modules if name not in ENCODER_MODULES) if chunks else unit.modules
            count = len(unit_stages) - chunks
            module = build_unit_stage(cfg, tokenizer, unit.name, modules, index - chunks, count, context, split)
        # model.float8 first, as TorchTitan converts at build: FSDP2 then all-gathers the FP8 weights
        apply_float8(module.model, float8, fsdp_all_gather=shard is not None)
        if tp_mesh is not None:
            apply_tensor_parallel(module.model, tp_mesh, sequence_overlap, sequence_parallel)
        if context is not None:
            apply_context_parallel(module.model, context)
        if experts is not None and unit.name == "llm":  # this rank's experts only, tokens exchanged all-to-all
            apply_expert_parallel(module.model, experts)
        tp_group = tp_mesh.get_group() if tp_mesh is not None else None  # full_partitioned splits over it
        apply_recompute(module.model, unit.recompute, unit.recompute_every, tp_group)
        if compile_blocks:  # before FSDP2, as TorchTitan orders them (parallel/compile.py)
            apply_compile(module.model)
        if shard is not None:  # FSDP2 (parallel/fsdp.py), still on meta: only this rank's shards get memory
            shard(module)
        module.to_empty(device=param_device or device)
        init_weights(module.model, seed=seed, std=cfg.init_std)
        if param_device is not None and param_device != device:
            for owner in module.modules():
                for name, buffer in owner.named_buffers(recurse=False):
                    owner._buffers[name] = buffer.to(device)
        stages[stage] = module
    return stages
