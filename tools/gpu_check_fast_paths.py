"""The fast paths' phase of tools/gpu_check.py (``fast_paths``): the kernels README's "fast paths" row had not run on a
GPU, each on the device against its plain path, forward and backward, numerics and time (CUDA events).

* **MoE experts** (``moe.experts_kernel``, models/grouped_experts.py): one MoE layer with ``grouped`` (torch's
  grouped matmul) against ``loop`` (a matmul per expert), under bf16 autocast (and in fp32 where the device runs
  grouped matmuls in fp32; where it does not, ``auto`` takes the loop and that is reported). Outputs, input and
  every parameter gradient against the fp32 loop: bf16 within 2x the loop's own bf16 error (plus 1e-3 absolute),
  fp32 within 1e-4.
* **Packed-document attention** (``model.document_attention``, models/document_attention.py): ``varlen`` (one
  causal SDPA per document) and ``flex`` (FlexAttention's block mask, compiled) against ``dense`` (the [S, S]
  mask), GQA, in fp32 and bf16. Against fp64 SDPA with the dense mask: fp32 within 1e-4, bf16 within 2x the
  dense bf16 call's error (plus 1e-6).

Each kernel's forward-and-backward time is the median of ``REPEATS`` after a warm-up (flex's first call
compiles). On the CPU the shapes are tiny and the times mean nothing; the numerics are checked the same way.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

REPEATS = 5
SHAPES = {
    "cuda": {"moe": (1024, 8, 2816, 8192), "attn": (2, 16, 4, 4096, 128), "docs": (300, 1700, 96, 2000)},
    "cpu": {"moe": (16, 4, 24, 64), "attn": (2, 4, 2, 64, 16), "docs": (10, 30, 3, 21)},
}


def _timed(fn, cuda: bool) -> tuple[object, float]:
    """``fn()``'s result and its median seconds over REPEATS runs after one warm-up."""
    result = fn()
    times = []
    for _ in range(REPEATS):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            import time

            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return result, statistics.median(times)


def _worst(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want, strict=True))


def _moe(check) -> dict:
    from disttrain_core.config.model import MoeConfig
    from disttrain_core.models.common import init_weights
    from disttrain_core.models.grouped_experts import grouped_available
    from disttrain_core.models.moe import MoeFeedForward

    dim, experts, ffn, tokens = SHAPES[check.device]["moe"]
    device = torch.device(check.device)
    layers = {}
    for kernel in ("loop", "grouped"):
        layer = MoeFeedForward(dim, MoeConfig(num_experts=experts, top_k=2, experts_kernel=kernel), ffn)
        init_weights(layer, 0, std=0.02)
        layer.aux_scale = 0.0
        layers[kernel] = layer.to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=g).to(device)
    upstream = torch.randn(tokens, dim, generator=g).to(device)

    def step(layer, dtype):
        def run():
            inp = x.clone().requires_grad_()
            layer.zero_grad(set_to_none=True)
            with torch.autocast(check.device, dtype=dtype, enabled=dtype != torch.float32):
                out = layer(inp)
            out.float().backward(upstream)
            return [out.detach(), inp.grad, *(p.grad for p in layer.parameters() if p.grad is not None)]

        return run

    reference, _ = _timed(step(layers["loop"], torch.float32), check.cuda)
    out = {"fp32_grouped_runs": grouped_available(device, torch.float32)}
    ok = True
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        if name == "fp32" and not out["fp32_grouped_runs"]:
            continue
        loop, loop_s = _timed(step(layers["loop"], dtype), check.cuda)
        grouped, grouped_s = _timed(step(layers["grouped"], dtype), check.cuda)
        error, loop_error = _worst(grouped, reference), _worst(loop, reference)
        bound = 1e-4 if name == "fp32" else 2 * loop_error + 1e-3
        ok &= error <= bound
        out[name] = {"grouped_error": error, "loop_error": loop_error, "loop_s": loop_s, "grouped_s": grouped_s}
        out[name]["grouped_over_loop"] = grouped_s / loop_s
    return {"ok": ok, **out}


def _attention(check) -> dict:
    from disttrain_core.models.document_attention import (
        dense_attention,
        flex_attention_documents,
        segments_of,
        varlen_attention,
    )

    batch, heads, kv_heads, seq, dim = SHAPES[check.device]["attn"]
    lengths = SHAPES[check.device]["docs"]
    row = [d for d, n in enumerate(lengths) for _ in range(n)]
    ids = torch.tensor([row, [len(lengths)] * seq], device=check.device)  # four documents; one filling the row
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, heads, seq, dim, generator=g).to(check.device)
    k, v = (torch.randn(batch, kv_heads, seq, dim, generator=g).to(check.device) for _ in range(2))
    upstream = torch.randn(batch, heads, seq, dim, generator=g).to(check.device)
    segments = segments_of(ids)
    kernels = {
        "dense": lambda a, b, c: dense_attention(a, b, c, ids, True),
        "varlen": lambda a, b, c: varlen_attention(a, b, c, segments, True),
        "flex": lambda a, b, c: flex_attention_documents(a, b, c, ids, True),
    }

    def step(kernel, dtype):
        def run():
            leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
            result = kernel(*leaves)
            result.backward(upstream.to(dtype))
            return [result.detach(), *(t.grad for t in leaves)]

        return run

    causal = torch.ones(seq, seq, dtype=torch.bool, device=check.device).tril()
    mask = ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]

    def fp64():
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        result = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
        result.backward(upstream.double())
        return [result.detach(), *(t.grad for t in leaves)]

    reference = fp64()
    out, ok = {}, True
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        dense_error = None
        for kernel, fn in kernels.items():
            if kernel == "flex" and not check.cuda:
                continue  # FlexAttention has no backward on the CPU (its forward: test_document_attention.py)
            results, seconds = _timed(step(fn, dtype), check.cuda)
            error = _worst(results, reference)
            dense_error = error if kernel == "dense" else dense_error
            bound = 1e-4 if name == "fp32" else 2 * dense_error + 1e-6
            ok &= error <= bound
            out[f"{name} {kernel}"] = {"max_abs_error": error, "seconds": seconds}
    return {"ok": ok, **out}


def phase_fast_paths(check) -> dict:
    """Grouped MoE experts against the per-expert loop, varlen and flex document attention against the dense
    mask, on the device. Added on the first H200 run (2026-12-04)."""
    moe, attention = _moe(check), _attention(check)
    return {"ok": moe["ok"] and attention["ok"], "moe_experts": moe, "document_attention": attention}
