"""The memory model's saved activations against what autograd saves, in fp32 and under bf16 autocast.

Measured per item (a batch of 2 minus a batch of 1, real CPU tensors, saved-tensor hooks): the weight copies
autocast makes are model-state transients (planner/memory.py), not activations, and drop out. Under bf16
autocast the residual stream and the norms stay fp32 and every linear layer saves its own bf16 copy of its
input; a model that counted every activation at 2 bytes under-counted a Llama block by ~40% (issue 36).
"""

from contextlib import nullcontext

import pytest
import torch

from disttrain_core.config import compose
from disttrain_core.planner import CostModel, Hardware, workload_of
from disttrain_core.planner.activation_count import counted_saved_bytes, cuda_autocast_policy
from disttrain_core.planner.costs import PlannerSettings

PRECISIONS = [("32", 0.05), ("bf16-mixed", 0.10)]


def _costs(model_overrides: list[str], precision: str, cluster: str = "h100_80g") -> CostModel:
    cfg = compose([*model_overrides, f"cluster={cluster}"])
    return CostModel(
        workload_of(cfg.model),
        Hardware.from_config(cfg.cluster, precision, peak_flops=1e12),
        PlannerSettings(precision=precision),
    )


def _per_item(run, make_inputs, precision: str, cuda_policy: bool = False) -> float:
    """Bytes autograd saves per item for ``run(*make_inputs(batch))`` (real tensors) under CPU bf16 autocast, or
    (``cuda_policy``) with the functions CUDA autocast keeps in fp32 kept in fp32 too."""
    counts = []
    for batch in (1, 2):
        rules = cuda_autocast_policy() if cuda_policy else nullcontext()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "32"), rules:
            counts.append(counted_saved_bytes(run, make_inputs(batch)))
    return counts[1] - counts[0]


@pytest.mark.parametrize("precision,bound", PRECISIONS)
def test_llama_block(precision, bound):
    from disttrain_core.models.llama import Llama

    m = compose(["model=mllm_small"]).model
    llm = Llama(m.llm, m.seq_len)
    block = llm.layers["0"]
    measured = _per_item(
        lambda h: block(h, llm.rope), lambda b: (torch.randn(b, m.seq_len, m.llm.dim, requires_grad=True),), precision
    )
    predicted = _costs(["model=mllm_small"], precision).activation_bytes("llm", 1, 1, "none") / m.llm.n_layers
    assert predicted / measured == pytest.approx(1.0, abs=bound), (predicted, measured)


@pytest.mark.parametrize("precision,bound", PRECISIONS)
def test_vit_block(precision, bound):
    from disttrain_core.models.vit import VitBlock, vit_block_count

    e = compose(["model=mllm_small"]).model.encoder
    tokens = (e.image_size // e.patch_size) ** 2 + int(e.class_token)
    block = VitBlock.of(e)
    measured = _per_item(block, lambda b: (torch.randn(b, tokens, e.dim, requires_grad=True),), precision)
    costs = _costs(["model=mllm_small"], precision)
    predicted = costs.activation_bytes("encoder", 1, 1, "none") / vit_block_count(e)
    assert predicted / measured == pytest.approx(1.0, abs=bound), (predicted, measured)


@pytest.mark.parametrize(
    "precision,bound,cluster", [(p, b, "local_cpu") for p, b in PRECISIONS] + [("bf16-mixed", 0.10, "h100_80g")]
)
def test_unet(precision, bound, cluster):
    """The generator's U-Net, every level (the model counts it on fake tensors; here real ones). Under bf16 the
    CPU and CUDA save different bytes -- CUDA autocast runs GroupNorm, LayerNorm and softmax in fp32 on the
    convolutions' bf16 outputs, 1.37x the CPU's for mllm_tiny -- and the model counts the cluster's: a CUDA
    cluster's against a CPU step with CUDA's fp32 list applied."""
    from disttrain_core.models.unet import UNet

    m = compose(["model=mllm_tiny"]).model
    g = m.generator
    side = m.gen_image_size // m.latent_downsample
    torch.manual_seed(0)
    unet = UNet(g)

    def inputs(batch):
        context = torch.randn(batch, m.gen_tokens, g.cross_attention_dim, requires_grad=True)
        return torch.randn(batch, g.in_channels, side, side), torch.zeros(batch, dtype=torch.long), context

    measured = _per_item(unet, inputs, precision, cuda_policy=cluster != "local_cpu")
    predicted = _costs(["model=mllm_tiny"], precision, cluster).activation_bytes("generator", 1, 1, "none")
    assert predicted / measured == pytest.approx(1.0, abs=bound), (predicted, measured)


def test_moe_block_under_autocast():
    from disttrain_core.models.llama import Llama

    overrides = [
        "model=llama_moe_tiny",
        "model.llm.dim=512",
        "model.llm.n_heads=8",
        "model.llm.moe.expert_ffn_dim=1024",
    ]
    m = compose(overrides).model
    torch.manual_seed(0)
    llm = Llama(m.llm, m.seq_len)
    block = llm.layers["0"]
    measured = _per_item(
        lambda h: block(h, llm.rope),
        lambda b: (torch.randn(b, m.seq_len, m.llm.dim, requires_grad=True),),
        "bf16-mixed",
    )
    predicted = _costs(overrides, "bf16-mixed").activation_bytes("llm", 1, 1, "none") / m.llm.n_layers
    assert predicted / measured == pytest.approx(1.0, abs=0.10), (predicted, measured)
