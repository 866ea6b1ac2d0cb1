"""``trainer.compile``: ``torch.compile`` per block, in every engine (TorchTitan's way).

Each block (a Llama decoder block, a ViT block, a U-Net residual block or spatial transformer: the
recompute blocks) gets a compiled ``forward``, after tensor, context and expert parallelism and recompute
are applied and before FSDP2 shards it. Parameter names, checkpoints and hooks do not change. The block's
own hooks -- FSDP2's all-gathers and reduce-scatters, ZeRO-1's waits for gathered parameters -- and
everything between blocks -- DDP's bucketed all-reduces, the pipeline executor's sends and receives -- run
eagerly where they did, so they overlap the backward as before: each compiled block's backward is one
autograd node, and its parameters' gradients are ready when it ends.

Shapes: the blocks of one kind share their compiled code (parameters are graph inputs), so the second and
later blocks reuse the first one's graph. The batch dimension of ViT and U-Net blocks (images and
generation targets per batch) is marked dynamic. Every other size is static: a HotSPa bucket's length or a
U-Net level's channels get a graph of their own (automatic dynamic shapes are off: torch 2.13 cannot
trace a tensor-parallel block with a symbolic sequence length), and the recompile limit is raised to fit
one graph per block.

:class:`CompileWatch` makes the costs visible: after each step it logs the graph breaks (with their
reasons, once each), the frames that fell back to eager (the recompile limit, an unsupported construct),
and any compilation after the first steps (a recompile), instead of leaving a slower run looking compiled.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter

import torch
import torch._dynamo
from torch import nn

from ..models.moe import MoeFeedForward
from ..models.unet import ResBlock, SpatialTransformer
from ..models.vit import VitBlock
from .recompute import BLOCKS

# Blocks whose batch dimension changes from batch to batch (images, generation targets): compiled with it
# dynamic, once, instead of once per count.
VARYING_BATCH = (VitBlock, ResBlock, SpatialTransformer)

log = logging.getLogger(__name__)


def apply_compile(module: nn.Module, backend: str = "inductor") -> int:
    """Compile every block of ``module`` in place; returns how many.

    Blocks of one class share a code object, and TorchDynamo keeps at most ``recompile_limit`` graphs per
    code object before running it eagerly. A U-Net's blocks differ in channels and resolution by design (one
    static graph per distinct shape is the fast kernel), so the limit is raised to the number of blocks of the
    most numerous class, plus headroom for the shapes that vary by batch.
    """
    blocks = [m for m in module.modules() if isinstance(m, BLOCKS)]
    per_class = Counter(type(block) for block in blocks)
    needed = max(per_class.values(), default=0) + 8
    if torch._dynamo.config.recompile_limit < needed:
        torch._dynamo.config.recompile_limit = needed
    # Only the batch dimension of VARYING_BATCH blocks (images, generation targets) is dynamic: a size that
    # changes otherwise (a HotSPa bucket's length, a U-Net level's channels) gets a static graph of its own
    # instead of a symbolic one (torch 2.13 cannot trace a tensor-parallel block with a symbolic sequence
    # length: the backward's trace overflows the recursion limit).
    torch._dynamo.config.automatic_dynamic_shapes = False
    for layer in [m for m in module.modules() if isinstance(m, MoeFeedForward)]:
        # routed experts stay eager between the block's compiled pieces: host-side routing counts, the
        # expert-parallel all-to-all, and the router's top-k (whose near-ties a fused softmax could flip)
        layer.forward = torch.compiler.disable(layer.forward)
    for block in blocks:
        # the block's forward (after recompute's wrapper, if any), not its __call__: hooks on the block --
        # FSDP2's all-gathers and reduce-scatters, ZeRO-1's waits for gathered parameters -- stay eager
        block.forward = _compiled_forward(block, backend)
    return len(blocks)


def _compiled_forward(block: nn.Module, backend: str):
    compiled = torch.compile(block.forward, backend=backend)
    if not isinstance(block, VARYING_BATCH):
        return compiled

    @functools.wraps(block.forward)
    def forward(*args, **kwargs):
        # marked here, after the block's hooks (FSDP2's may hand the forward new tensors)
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(value, 0)
        return compiled(*args, **kwargs)

    return forward


def _first_line(reason: str) -> str:
    """The reason's first line and, where TorchDynamo gives one, its explanation (which names the function)."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    if not lines:
        return "(no reason given)"
    explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), None)
    return f"{lines[0]} ({explanation})" if explanation else lines[0]


class CompileWatch:
    """Reads TorchDynamo's counters after each step and logs what changed (see the module docstring)."""

    def __init__(self, rank: int, warmup_steps: int = 2):
        from torch._dynamo.utils import counters

        self.counters = counters
        self.rank = rank
        self.warmup_steps = warmup_steps
        self.seen: set[str] = set()
        self.graphs = self._graphs()
        self.breaks = 0
        self.fallbacks = 0
        self.recompiles = 0

    def _graphs(self) -> int:
        return int(self.counters["stats"].get("unique_graphs", 0))

    def after_step(self, step: int) -> None:
        for kind, label in (("graph_break", "graph break"), ("unimplemented", "ran eagerly")):
            for reason, count in self.counters[kind].items():
                key = f"{kind}:{reason}"
                if key in self.seen:
                    continue
                self.seen.add(key)
                if kind == "graph_break":
                    self.breaks += 1
                else:
                    self.fallbacks += 1
                log.warning(
                    "rank %d: trainer.compile %s (%d time(s) by step %d): %s",
                    self.rank,
                    label,
                    count,
                    step,
                    _first_line(reason),
                )
        graphs = self._graphs()
        if graphs > self.graphs and step > self.warmup_steps:
            self.recompiles += graphs - self.graphs
            log.warning(
                "rank %d: trainer.compile compiled %d more graph(s) at step %d (%d in all): shapes or guards "
                "changed; TORCH_LOGS=recompiles names the reason",
                self.rank,
                graphs - self.graphs,
                step,
                graphs,
            )
        self.graphs = graphs

    def metrics(self) -> dict[str, float]:
        return {
            "compile/graphs": float(self.graphs),
            "compile/graph_breaks": float(self.breaks),
            "compile/eager_fallbacks": float(self.fallbacks),
            "compile/recompiles": float(self.recompiles),
        }
