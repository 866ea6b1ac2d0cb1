"""A resolved unit against the shapes of the models it holds: tensor parallelism divides their heads, widths
and vocabulary (the U-Net's transformers included), pipeline stages split their blocks, and the MoE routing
settings and layouts (validation/layout.py calls these per unit)."""

from __future__ import annotations

from ..config import Config
from .common import ConfigError, _require


def validate_moe_unit(cfg: Config, unit) -> None:
    """The MoE routing settings, and the layouts the MoE blocks train in."""
    from ..models.moe import check_routing

    moe = cfg.model.llm.moe
    try:
        check_routing(moe.num_experts, moe.top_k, moe.capacity_factor, moe.router, moe.experts_kernel)
    except ValueError as error:
        raise ConfigError(f"model.llm.{error}") from None
    if unit.tp > 1:  # each expert's hidden width splits over the TP ranks (parallel/tensor_parallel.py)
        hidden = moe.expert_ffn_dim or cfg.model.llm.ffn_dim
        what = f"model.llm.moe.expert_ffn_dim={hidden}" if moe.expert_ffn_dim else f"model.llm.ffn_dim={hidden}"
        _require(
            hidden % unit.tp == 0,
            f"the {unit.name} unit (tp={unit.tp}): tp does not divide the experts' hidden width {what} (each expert "
            "splits it over the TP ranks); pick tp among its divisors",
        )
        _require(
            not cfg.parallel.comm.tp_overlap,
            f"the {unit.name} unit (tp={unit.tp}): parallel.comm.tp_overlap=true chunks dense Llama blocks only; "
            "model.llm.moe blocks run sequence parallelism unchunked: set parallel.comm.tp_overlap=false",
        )
    if unit.ep > 1:
        from ..parallel.expert_parallel import validate_moe

        try:
            validate_moe(moe.num_experts, moe.top_k, ep=unit.ep, dp=unit.dp)
        except ValueError as error:
            raise ConfigError(f"the {unit.name} unit: {error}") from None


def validate_unit_tp(cfg: Config, unit, where: str) -> None:
    """A unit's tensor-parallel size divides the heads and hidden sizes of the models it holds."""
    p, m = cfg.parallel, cfg.model
    if "llm" in unit.modules:
        llm = m.llm
        for what, value in (("n_heads", llm.n_heads), ("n_kv_heads", llm.n_kv_heads), ("ffn_dim", llm.ffn_dim)):
            _require(value % unit.tp == 0, f"{where}: tp={unit.tp} does not divide model.llm.{what}={value}")
        padded = -(-llm.vocab_size // unit.tp) * unit.tp
        _require(
            llm.vocab_size % unit.tp == 0,
            f"{where}: tp={unit.tp} does not divide model.llm.vocab_size={llm.vocab_size} (the embedding and the "
            f"head split the vocabulary over TP); pad it: model.llm.vocab_size={padded} (the extra rows are never "
            "a label)",
        )
        _require(
            not p.comm.tp_overlap or m.seq_len % unit.tp == 0,
            f"parallel.comm.tp_overlap=true splits the sequence over the TP group, but tp={unit.tp} does "
            f"not divide model.seq_len={m.seq_len}; change one of them or set tp_overlap=false",
        )
    for module in ("encoder", "audio_encoder"):  # ViT blocks, split over the TP group of the unit holding them
        if module in unit.modules:
            vit = getattr(m, module)
            for what, value in (("n_heads", vit.n_heads), ("mlp_dim", vit.mlp_dim)):
                _require(value % unit.tp == 0, f"{where}: tp={unit.tp} does not divide model.{module}.{what}={value}")
    # the generator unit of a manual layout: its tp was chosen for it. Sharing another unit's TP group
    # (megatron mode, or colocated with the LLM), a U-Net whose heads do not divide stays replicated there.
    if unit.name in ("generator", "audio_generator") and cfg.parallel.mode == "manual":
        _validate_generator_tp(getattr(m, unit.name), unit.tp, where)


def _validate_generator_tp(gen, tp: int, where: str) -> None:
    """TP splits the heads of every U-Net transformer (the attended levels and the middle block)."""
    from ..models.unet import level_head_dims

    try:
        head_dims = level_head_dims(gen)
    except ValueError as error:
        raise ConfigError(f"model.{error}") from None
    chans = list(gen.block_out_channels)
    attended = [level for level, on in enumerate(gen.cross_attention_blocks) if on] + [len(chans) - 1]
    for level in dict.fromkeys(attended):
        heads = chans[level] // head_dims[level]
        _require(
            heads % tp == 0,
            f"{where}: tp={tp} does not divide the U-Net's {heads} attention head(s) at level {level} "
            f"(model.generator.block_out_channels[{level}]={chans[level]} / head width {head_dims[level]}); "
            f"pick a tp that divides it, or change model.generator.head_dim / attention_heads",
        )


def validate_unit_pp(cfg: Config, unit, where: str) -> None:
    """The encoder's blocks split evenly into its pipeline stages; the U-Net has enough pieces for the generator's."""
    m = cfg.model
    if unit.name == "encoder":
        from ..models.vit import vit_block_count

        blocks, layer = vit_block_count(m.encoder), m.encoder.feature_layer
        what = f"model.encoder.n_layers={blocks}"
        if layer is not None:
            what = f"the {blocks} encoder block(s) built for model.encoder.feature_layer={layer} "
            what += f"(n_layers={m.encoder.n_layers})"
        _require(blocks % unit.pp == 0, f"{where}: pp={unit.pp} does not divide {what}")
    if unit.name == "generator":  # cut at level boundaries (parallel/generator_stages.py)
        pieces = 2 * len(m.generator.block_out_channels) + 1
        _require(
            unit.pp <= pieces,
            f"{where}: pp={unit.pp}; the U-Net splits into pipeline stages at level boundaries and has {pieces} "
            f"pieces (each level down, the middle block, each level up): use pp <= {pieces}",
        )
