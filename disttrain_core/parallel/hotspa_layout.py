"""HotSPa's strategies as configs and layouts: which strategy serves which bucket, which one is home, the
config each strategy's engine is built from, and every parameter's box under each (parallel/switch_plan.py).
"""

from __future__ import annotations

import re

import torch
from omegaconf import OmegaConf

from ..config import Config
from ..data.packing import bucket_boundaries, microbatch_rows
from ..data.tokenizer import Tokenizer
from .switch_plan import ParamSpec, Strategy, strategy_layout


def parse_strategies(cfg: Config) -> list[Strategy]:
    if list(cfg.parallel.hotspa.strategies) == ["auto"]:
        raise ValueError(
            "parallel.hotspa.strategies=[auto] is chosen by train.py before launch (planner/hotspa_auto.py); "
            "name one strategy per bucket to use it here"
        )
    return [Strategy.parse(s) for s in cfg.parallel.hotspa.strategies]


def bucket_strategies(cfg: Config, tokenizer: Tokenizer | None = None) -> tuple[list[Strategy], list[int], str]:
    """(strategy per bucket, bucket capacities, the home strategy's name)."""
    strategies = parse_strategies(cfg)
    capacities = bucket_boundaries(cfg)
    home = cfg.parallel.hotspa.home
    if home is None:
        home = least_state(strategies, llm_param_specs(cfg, tokenizer), cfg.model.llm.n_layers)
    return strategies, capacities, Strategy.parse(home).name


def least_state(strategies: list[Strategy], specs: dict[str, ParamSpec], layers: int) -> str:
    """The strategy whose busiest process holds the least model state: fp32 parameters and gradients of its
    boxes plus AdamW's master and two moments sharded over dp x cp (ZeRO-1); ties: the first listed."""

    def busiest(strategy: Strategy) -> float:
        layout = strategy_layout(specs, strategy, layers)
        held = [0] * strategy.world
        for boxes in layout.values():
            for rank, box in boxes.items():
                numel = 1
                for a, b in box:
                    numel *= b - a
                held[rank] += numel
        return max(held) * (8 + 12 / (strategy.dp * strategy.cp))

    return min(strategies, key=busiest).name


_TP_DIMS = {  # parallel/tensor_parallel.py LLAMA_PLAN: column-parallel weights split dim 0, row-parallel dim 1
    "attention.wq": 0,
    "attention.wk": 0,
    "attention.wv": 0,
    "attention.wo": 1,
    "feed_forward.w1": 0,
    "feed_forward.w3": 0,
    "feed_forward.w2": 1,
}


def llm_param_specs(cfg: Config, tokenizer: Tokenizer | None = None) -> dict[str, ParamSpec]:
    """Every trainable parameter of a text-only Llama, named as the stages name it, with its tp dimension
    and layer (meta device: nothing is allocated)."""
    from ..data.tokenizer import tokenizer_for
    from ..models import build_model
    from .tensor_parallel import LLAMA_PLAN

    tokenizer = tokenizer or tokenizer_for(cfg)
    assert set(_TP_DIMS) == set(LLAMA_PLAN), "the tensor-parallel plan changed: update _TP_DIMS"
    model = build_model(cfg.model, tokenizer, device="meta")
    specs = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        found = re.fullmatch(r"llm\.layers\.(\d+)\.(.+)\.weight", name)
        if found:
            layer, module = int(found.group(1)), found.group(2)
            specs[name] = ParamSpec(tuple(p.shape), _TP_DIMS.get(module), layer)
        elif name.startswith("llm.tok_embeddings."):  # vocabulary-parallel: rows split over TP
            specs[name] = ParamSpec(tuple(p.shape), 0, None, "first")
        elif name.startswith("llm.output."):
            specs[name] = ParamSpec(tuple(p.shape), 0, None, "last")
        elif name.startswith("llm.norm."):
            specs[name] = ParamSpec(tuple(p.shape), None, None, "last")
        else:
            raise ValueError(f"parallel.mode=hotspa trains text-only Llama models; {name} is not one (model.name)")
    return specs


def bucket_recompute(cfg: Config, bucket: int) -> str:
    """The recompute policy of bucket ``bucket``: ``parallel.hotspa.recompute[bucket]`` or parallel.recompute."""
    policies = cfg.parallel.hotspa.recompute
    return str(policies[bucket]) if policies else str(cfg.parallel.recompute)


def strategy_config(
    cfg: Config, strategy: Strategy, capacity: int, recompute: str | None = None, extra: dict | None = None
) -> Config:
    """The config one strategy's engine is built from: the rigid layout with its sizes, rows of its bucket,
    the bucket's recompute policy (``recompute``; None: parallel.recompute); ``extra``: a patch merged after it
    in the same merge (each ``OmegaConf.merge`` deep-copies the whole typed config: the planner's HotSPa
    predictions spent most of their time copying it)."""
    schedule = "none" if strategy.pp == 1 else (cfg.schedule.name if cfg.schedule.name != "none" else "1f1b")
    rows = microbatch_rows(cfg.data.packing, capacity)
    patch = {
        "parallel": {
            "mode": "megatron",
            "dp": strategy.dp,
            "tp": strategy.tp,
            "pp": strategy.pp,
            "cp": strategy.cp,
            "shard": "zero1",
            "recompute": recompute or cfg.parallel.recompute,
        },
        "model": {"seq_len": int(capacity)},
        "schedule": {"name": schedule, "vpp": 1},
        "optim": {
            "micro_batch_size": rows,
            "global_batch_size": rows * strategy.dp,
        },
    }
    return OmegaConf.merge(cfg, patch, extra or {})


def local_box_tensors(named_parameters, layout: dict, rank: int, check: bool = False) -> dict[str, torch.Tensor]:
    """This rank's live tensors (DTensor shards as local tensors) by name; ``check``: they are exactly the
    boxes ``layout`` assigns it."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in named_parameters:
        data = p.data.to_local() if isinstance(p.data, DTensor) else p.data
        out[name] = data
        if check:
            box = layout.get(name, {}).get(rank)
            if box is None or tuple(b - a for a, b in box) != tuple(data.shape):
                raise AssertionError(f"rank {rank}: {name} holds {tuple(data.shape)}, the switch plan expects {box}")
    if check:
        expected = {name for name, boxes in layout.items() if rank in boxes}
        if expected != set(out):
            raise AssertionError(f"rank {rank}: parameters {sorted(expected ^ set(out))[:3]} differ from the plan")
    return out
