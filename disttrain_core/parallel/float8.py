"""``model.float8``: FP8 training of the LLM's linear layers through torchao's float8 training.

``tensorwise`` (one scale per tensor: the fastest, and with FSDP2 the weights are all-gathered in FP8) or
``rowwise`` (one scale per row: closer to bf16 on outliers, slower). Every ``nn.Linear`` inside an LLM
decoder block whose two dimensions are multiples of 16 (the FP8 matmul's requirement) becomes torchao's
``Float8Linear``: its input, weight and output gradient are cast to FP8 (e4m3 forward, e5m2 gradients) with
dynamic scales and multiplied by ``torch._scaled_mm``; the weights themselves stay in their own dtype, so
parameter names, checkpoints and the optimizer do not change. The embeddings, the LM head, norms, the ViT,
the U-Net, the projectors and MoE experts (grouped matmuls) stay as they are -- TorchTitan's default.

Applied right after the model is built on the meta device, before tensor parallelism, recompute,
``trainer.compile`` (which fuses the casts into the matmuls' neighbours) and FSDP2. Validation refuses it off
CUDA and on GPUs without FP8 tensor cores (compute capability below 8.9), and with tensor parallelism
(torchao's float8 TP plans are not wired into parallel/tensor_parallel.py).

``emulate=True`` (tests only) runs the same casts with the matmul in high precision: the numerics of FP8
storage on a CPU, not its speed.
"""

from __future__ import annotations

import dataclasses

from torch import nn

RECIPES = ("none", "tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # Ada (L40S, RTX 4090) and Hopper (H100, H200) have FP8 tensor cores


def fp8_eligible(module: nn.Module) -> bool:
    """A linear layer the FP8 matmul can run: both dimensions multiples of 16."""
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module, recipe: str, fsdp_all_gather: bool = False, emulate: bool = False) -> int:
    """Convert the eligible linears of every LLM decoder block in ``model`` to ``Float8Linear``; returns how
    many. ``fsdp_all_gather``: FSDP2 all-gathers the weights in FP8 (tensorwise only)."""
    if recipe == "none":
        return 0
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    from ..models.llama import DecoderBlock

    if recipe not in RECIPES:
        raise ValueError(f"model.float8={recipe!r}: allowed values are {', '.join(RECIPES)}")
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe),
        enable_fsdp_float8_all_gather=fsdp_all_gather and recipe == "tensorwise",
        emulate=emulate,
    )
    for block in [m for m in model.modules() if isinstance(m, DecoderBlock)]:
        convert_to_float8_training(block, config=config, module_filter_fn=lambda m, _name: fp8_eligible(m))
    return sum(1 for m in model.modules() if isinstance(m, Float8Linear))


def precompute_fp8_scales(models: list[nn.Module]) -> None:
    """After the optimizer step, with FSDP2's FP8 all-gather: every weight's scale in one fused pass, instead
    of one small reduction per weight inside the next forward (torchao's recommendation)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for model in models:
        precompute_float8_dynamic_scale_for_fsdp(model)
