"""The context-parallel modes of the one-GPU check (tools/gpu_check.py ``cp_modes``): each mode emulated in this
process (one GPU per process, so the ranks run one after another) with the kernels its ranks run on a device.

* ``allgather`` computes what the ring computes, blocks taken from their owners at once: the ring's emulation
  (comm/ring_attention.py ``emulated_ring_attention``) is that computation;
* ``ulysses`` at cp: every rank's head group (``H / cp`` query heads and their K/V heads, copied ``cp / kv`` times
  when there are fewer: comm/context_modes.py ``kv_replicas``) attends over the whole sequence with the model's
  own attention (SDPA, or one call per document for packed rows: models/document_attention.py ``varlen``);
* ``hybrid`` at cp 4 (2 x 2): each head group of 2 runs the ring's emulation over 2 ring ranks.

Each against fp64 SDPA of the whole sequence: fp32 outputs and q/k/v gradients within 1e-4; bf16 outputs within
2x one bf16 SDPA call's error on the same inputs.
"""

from __future__ import annotations

import json

import torch
from gpu_check_phases import _reference, _sdpa_error


def _ulysses(q, k, v, docs, ulysses: int, ring: int):
    """Attention by head groups of ``ulysses`` ranks, each over the whole sequence (``ring`` > 1: the ring's
    emulation over that many ranks)."""
    from disttrain_core.comm.context_modes import kv_replicas
    from disttrain_core.comm.ring_attention import emulated_ring_attention
    from disttrain_core.models.document_attention import varlen_attention
    from disttrain_core.models.llama import Documents

    copies = kv_replicas(k.shape[1], ulysses)
    k, v = (t.repeat_interleave(copies, dim=1) for t in (k, v))
    heads, kv_heads = q.shape[1] // ulysses, k.shape[1] // ulysses
    outs = []
    for i in range(ulysses):
        qi, ki, vi = (
            q[:, i * heads : (i + 1) * heads],
            k[:, i * kv_heads : (i + 1) * kv_heads],
            v[:, i * kv_heads : (i + 1) * kv_heads],
        )
        if ring > 1:
            outs.append(emulated_ring_attention(qi, ki, vi, ring, doc_ids=docs))
        elif docs is not None:
            outs.append(varlen_attention(qi, ki, vi, Documents(docs, docs).segments(), qi.shape[1] != ki.shape[1]))
        else:
            outs.append(torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True))
    return torch.cat(outs, dim=1)


def _mode(name: str, world: int):
    from disttrain_core.comm.ring_attention import emulated_ring_attention

    if name == "allgather":
        return lambda q, k, v, docs: emulated_ring_attention(q, k, v, world, doc_ids=docs)
    if name == "ulysses":
        return lambda q, k, v, docs: _ulysses(q, k, v, docs, world, 1)
    return lambda q, k, v, docs: _ulysses(q, k, v, docs, 2, world // 2)


def _run(attend, q, k, v, docs, upstream):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = attend(*leaves, docs)
    grads = torch.autograd.grad((out.float() * upstream).sum(), leaves)
    return out.detach().float(), [g.float() for g in grads]


def phase_cp_modes(check) -> dict:
    """Each mode at cp 2 and 4 (hybrid at 4) against fp64 SDPA, causal and packed, fp32 and bf16 (module doc)."""
    r = check.ring
    g = torch.Generator(device=check.device).manual_seed(1)
    q = torch.randn((1, r["heads"], r["seq"], r["head_dim"]), generator=g, device=check.device)
    k, v = (
        torch.randn((1, r["kv_heads"], r["seq"], r["head_dim"]), generator=g, device=check.device) for _ in range(2)
    )
    upstream = torch.randn(q.shape, generator=g, device=check.device)
    third = r["seq"] // 3
    docs = torch.tensor([[0] * third + [1] * third + [2] * (r["seq"] - 2 * third)], device=check.device)
    errors, ok = {}, True
    cases = [("allgather", 2), ("allgather", 4), ("ulysses", 2), ("ulysses", 4), ("hybrid", 4)]
    for name, world in cases:
        attend = _mode(name, world)
        for ids, tag in ((None, ""), (docs, " packed")):
            ref_out, ref_grads = _reference(q, k, v, ids, upstream)
            out, grads = _run(attend, q, k, v, ids, upstream)
            pairs = [(out, ref_out), *zip(grads, ref_grads, strict=True)]
            errors[f"fp32 {name} cp{world}{tag}"] = max((a - b).abs().max().item() for a, b in pairs)
            ok &= errors[f"fp32 {name} cp{world}{tag}"] < 1e-4
            low = [t.bfloat16() for t in (q, k, v)]
            with torch.autocast(check.device, dtype=torch.bfloat16):
                out, _ = _run(attend, *low, ids, upstream)
            errors[f"bf16 {name} cp{world}{tag}"] = (out - ref_out).abs().max().item()
            ok &= errors[f"bf16 {name} cp{world}{tag}"] <= 2 * _sdpa_error(*low, ref_out, ids) + 1e-6
    return {"ok": ok, "max_abs_error": errors}


# Two runs that must agree: deterministic kernels (on CUDA the attention and embedding backwards otherwise
# accumulate in a run-dependent order: on the first H200 run the pairs differed by 1e-4 after 10 steps, with or
# without offload's part in it), every step's loss logged.
SAME_RUNS = ["trainer.deterministic=true", "trainer.log_every_n_steps=1"]
# The optimizer-offload pair runs different AdamW kernels (the host's and the device's), whose last-ulp differences
# grow with the loss when the learning rate makes it climb (the check's warm-up to 3e-3 does on this Llama); at
# 3e-4 the loss falls and the comparison measures offload, not that growth. fp32 without TF32.
STABLE = ["optim.lr=3e-4", "trainer.precision=32", "trainer.tf32=false"]


def phase_offload(check) -> dict:
    """parallel.offload=optimizer on the device (parallel/offload.py): the ~1B Llama's ZeRO-1 run (one rank, fp32)
    with the master shards and AdamW's moments in pinned host memory, against the same run without: losses within
    1e-5 relative (the host's fused AdamW and the device's are different kernels), the device's peak lower, the
    step time of each reported. Added for issue 63."""
    from gpu_check_phases import tokens_runs, train

    runs = {}
    for name, extra in (("device", []), ("offload", ["parallel.offload=optimizer"])):
        metrics = train(check, f"offload_{name}", [*tokens_runs(check), *SAME_RUNS, *STABLE, "parallel=zero1", *extra])
        runs[name] = {
            "losses": [m["loss"] for m in metrics],
            "peak_memory_gib": max(m["perf/peak_memory_gib"] for m in metrics),
            "step_time_s": metrics[-1]["perf/step_time_s"],
        }
    pairs = zip(runs["offload"]["losses"], runs["device"]["losses"], strict=True)
    worst = max(abs(a - b) / abs(b) for a, b in pairs)
    lower = runs["offload"]["peak_memory_gib"] < runs["device"]["peak_memory_gib"] or not check.cuda
    return {"ok": worst < 1e-5 and lower, "worst_relative_loss_difference": worst, **runs}


def phase_act_offload(check) -> dict:
    """parallel.recompute=offload on the device (parallel/saved_activations.py): the Llama's run (one rank) with
    every block's saved tensors in pinned host memory, copied on a side stream, against recompute=none: the same
    losses (the restored tensors are the saved bytes: equal up to 1e-6 relative), a lower measured peak, the memory
    model's predicted peak beside the measured one, and each step time. Added for issue 63."""
    from gpu_check_phases import tokens_runs, train

    runs = {}
    for policy in ("none", "offload"):
        overrides = [*tokens_runs(check), *SAME_RUNS, f"parallel.recompute={policy}", "trainer.memory_report_step=2"]
        metrics = train(check, f"act_offload_{policy}", overrides)
        report = json.loads((check.scratch / f"act_offload_{policy}" / "memory" / "rank00000.json").read_text())
        runs[policy] = {
            "losses": [m["loss"] for m in metrics],
            "measured_peak_bytes": report["measured"]["peak"],
            "predicted_peak_bytes": report["predicted"]["peak"],
            "step_time_s": metrics[-1]["perf/step_time_s"],
        }
    pairs = zip(runs["offload"]["losses"], runs["none"]["losses"], strict=True)
    worst = max(abs(a - b) / abs(b) for a, b in pairs)
    lower = runs["offload"]["measured_peak_bytes"] < runs["none"]["measured_peak_bytes"] or not check.cuda
    link = _host_link_gbps() if check.cuda else {}
    return {"ok": worst < 1e-6 and lower, "worst_relative_loss_difference": worst, **runs, "host_link_gbps": link}


def _host_link_gbps(gib: int = 2) -> dict:
    """GB/s of one pinned host buffer copied to the device and back (CUDA events; cluster.host_bandwidth_gbps)."""
    host = torch.empty(gib << 30, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    out = {}
    for name, (dst, src) in {"to_device": (device, host), "to_host": (host, device)}.items():
        dst.copy_(src, non_blocking=True)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        out[name] = round(3 * host.numel() / (start.elapsed_time(end) / 1e3) / 1e9, 1)
    return out
