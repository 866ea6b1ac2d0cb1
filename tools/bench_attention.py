"""Packed-document attention: what the Llama's dense document mask costs against the kernels that need none.

One attention core, forward + backward, on [batch, heads, seq, head_dim] queries (GQA keys/values) whose rows
pack ``docs`` documents of equal length, four ways (models/document_attention.py, ``model.document_attention``):

* ``dense_mask``: ``dense``, a [B, 1, S, S] boolean document-and-causal mask handed to SDPA, which rules out the
  flash kernel (what packed rows ran before ``varlen``);
* ``varlen``: one causal SDPA per document of each row (the default, ``auto``);
* ``flex``: FlexAttention (compiled) with a block mask of the same documents;
* ``causal_unpacked``: causal SDPA on the same shape with no documents (the flash kernel on CUDA): the floor
  a document mask could reach, not the same function.

Per variant: the median forward + backward time after ``warmup`` (CUDA events on a GPU, ``perf_counter`` on
a CPU), the allocator's peak bytes above the inputs (CUDA only), and for ``varlen`` and ``flex`` the largest
difference from ``dense_mask`` (output and input gradients). FlexAttention has no backward on a CPU (torch 2.13
refuses it): there it is reported as unsupported.

    python tools/bench_attention.py                                  # CUDA: seq 8192, 32/8 heads of 128, bf16
    python tools/bench_attention.py device=cpu seq=256 heads=4 kv_heads=2 head_dim=16 dtype=float32 repeats=3
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from disttrain_core.config import REPO_ROOT
from disttrain_core.launch.cli import tool_main, tool_options
from disttrain_core.models.document_attention import dense_attention, segments_of, varlen_attention

OPTIONS = {
    "device": "auto",
    "batch": "1",
    "seq": "8192",
    "heads": "32",
    "kv_heads": "8",
    "head_dim": "128",
    "docs": "8",
    "dtype": "bfloat16",
    "warmup": "3",
    "repeats": "10",
    "out": str(REPO_ROOT / "outputs" / "bench_attention.json"),
}


def _inputs(o: dict, device: torch.device, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    b, s, d = o["batch"], o["seq"], o["head_dim"]
    q = torch.randn(b, o["heads"], s, d, generator=g, device=device, dtype=dtype)
    k, v = (torch.randn(b, o["kv_heads"], s, d, generator=g, device=device, dtype=dtype) for _ in range(2))
    upstream = torch.randn_like(q)
    ids = (torch.arange(s, device=device) * o["docs"] // s).expand(b, s).contiguous()
    return q, k, v, upstream, ids


def _variants(ids: torch.Tensor, o: dict):
    segments = segments_of(ids)

    def dense(q, k, v):
        return dense_attention(q, k, v, ids, q.shape[1] != k.shape[1])

    def varlen(q, k, v):
        return varlen_attention(q, k, v, segments, q.shape[1] != k.shape[1])

    def causal(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])

    out = {"dense_mask": dense, "varlen": varlen, "causal_unpacked": causal}
    if ids.device.type == "cpu":
        return out, {"flex": "FlexAttention has no backward on a CPU (torch refuses requires_grad inputs)"}
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def same_document_causal(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(same_document_causal, o["batch"], None, o["seq"], o["seq"], device=ids.device)
    compiled = torch.compile(flex_attention)

    def flex(q, k, v):
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])

    out["flex"] = flex
    return out, {}


def _step(function, q, k, v, upstream):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = function(*leaves)
    grads = torch.autograd.grad(out, leaves, upstream)
    return out.detach(), grads


def _time(function, inputs, o: dict, cuda: bool) -> dict:
    for _ in range(o["warmup"]):
        _step(function, *inputs)
    times = []
    for _ in range(o["repeats"]):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start.record()
            _step(function, *inputs)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            _step(function, *inputs)
            times.append(time.perf_counter() - started)
    result = {"median_s": statistics.median(times), "min_s": min(times)}
    if cuda:
        result["peak_bytes_above_inputs"] = torch.cuda.max_memory_allocated() - base
    return result


def bench(o: dict) -> dict:
    device = torch.device(o["device"])
    dtype = getattr(torch, o["dtype"])
    cuda = device.type == "cuda"
    q, k, v, upstream, ids = _inputs(o, device, dtype)
    functions, unsupported = _variants(ids, o)
    results = {name: _time(fn, (q, k, v, upstream), o, cuda) for name, fn in functions.items()}
    results.update({name: {"unsupported": why} for name, why in unsupported.items()})
    ref_out, ref_grads = _step(functions["dense_mask"], q, k, v, upstream)
    for name in ("varlen", "flex"):
        if name in functions:
            out, grads = _step(functions[name], q, k, v, upstream)
            pairs = zip((out, *grads), (ref_out, *ref_grads), strict=True)
            results[name]["max_abs_difference_from_dense"] = max(
                (a.float() - b.float()).abs().max().item() for a, b in pairs
            )
    dense = results["dense_mask"]["median_s"]
    for result in results.values():
        if "median_s" in result:
            result["speed_over_dense_mask"] = dense / result["median_s"]
    return results


def main(argv: list[str]) -> int:
    options = tool_options(argv, OPTIONS)
    o = {k: (v if k in ("device", "dtype", "out") else int(v)) for k, v in options.items()}
    if o["device"] == "auto":
        o["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if o["seq"] % o["docs"]:
        print(f"error: seq={o['seq']} is not a multiple of docs={o['docs']}", file=sys.stderr)
        return 2
    if not isinstance(getattr(torch, o["dtype"], None), torch.dtype):
        print(f"error: dtype={o['dtype']!r} is not a torch dtype (bfloat16, float16, float32)", file=sys.stderr)
        return 2
    results = bench(o)
    machine = {"torch": torch.__version__, "device": o["device"]}
    if o["device"] == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(0)
    report = {"machine": machine, "settings": {k: v for k, v in o.items() if k != "out"}, "variants": results}
    out = Path(o["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    for name, result in results.items():
        if "median_s" in result:
            print(f"{name:16s} {result['median_s'] * 1e3:9.2f} ms  {result['speed_over_dense_mask']:5.2f}x dense")
        else:
            print(f"{name:16s} unsupported: {result['unsupported']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(tool_main(main, sys.argv[1:]))
