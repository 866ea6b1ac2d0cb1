"""The training paths' phase of tools/gpu_check.py (``train_paths``): the fast paths that ran on a GPU only as single
layers (the ``fast_paths`` phase), now inside short training runs, each against the run with its plain path.

* **Grouped MoE experts** (``moe.experts_kernel``): a small MoE Llama trained through the runtime (``train.py``
  in this process, as the offload phases run it) with ``grouped`` and with ``loop``; every call of
  ``torch._grouped_mm`` during each run is counted, so the grouped run cannot have fallen back to the loop.
* **Packed-document attention** (``model.document_attention``): a small Llama trained on packed synthetic
  documents (``data=longtail_text``: many documents per row) with ``flex`` (CUDA only: torch has no FlexAttention
  backward on the CPU, and training refuses it there) and ``varlen`` against ``dense`` (the [S, S] mask).
* **FSDP2 with CPU offload** (``parallel.offload=optimizer`` under ``shard=zero3``: torch's ``CPUOffloadPolicy``,
  parameters, gradients and AdamW on the host). ``train.py`` refuses zero3 on one rank (its refusal is recorded
  in the result): FSDP2 shards over at least 2 ranks there, and one GPU cannot hold 2 NCCL ranks. So the
  runtime's own pieces run it on a one-rank process group (NCCL on CUDA) as the units engine builds them
  (``units_of``, ``build_pipeline``, ``build_rank_stages`` with the host as ``param_device``, ``apply_fsdp``,
  ``ShardedOptimizer``), against the same run without offload: the losses, and on CUDA the peak allocated memory.
  Both runs draw their initial weights on the host generator (models/common.py ``_seeded_normal_into``,
  ``on_device=False``): the runtime draws them where the parameters live, and CUDA's generator gives other values
  than the host's for the same seed, so on CUDA an offloaded zero3 run (parameters on the host) does not start
  where the run without offload starts (``runtime_init_differs_host_vs_device`` in the result; the first H200 try
  of this phase compared the runtime's two starts and failed on it). The pair compares offload from one start.

Every pair runs fp32 without TF32, deterministic kernels, lr 3e-4, the same seed and data (gpu_check_cp.py's
``SAME_RUNS`` and ``STABLE``), every step logged. The data are the synthetic motif documents (a 3-8 token motif
repeated, 5% noise), so where attention looks changes the loss from the first step even before the model has
learned much in these few steps. A control shows the comparison can fail: the document run again with attention
leaking across documents (plain causal) must differ from ``dense`` by more than the bound.

Bounds, as relative differences at any step: **1e-4** for the loss and the gradient norm of the kernel pairs (a)
and (b). Those runs differ only in the summation order of one kernel (fp32: ~1e-7 relative per op; the fast_paths
phase measured the layers within 3.5e-5 absolute of fp64 on the H200), and routing is discontinuous: a token whose
top-2 scores nearly tie may take another expert in one run, which moves the step's mean loss by about that token's
change over the thousands of tokens of the step. The bound leaves room for such flips; a cross-document leak moves
the loss and the gradient norm by far more (the control). **1e-5** for the loss under offload: the host's fused
AdamW and the device's are different kernels, the bound and the reason of the ``offload`` phase.

Step times are the median over the steps after the first two (flex compiles its kernels in the first); on the CPU
the shapes are tiny and the times mean nothing. The whole phase is about a minute on one H200 (docs/GPU.md).
"""

from __future__ import annotations

import contextlib
import io
import statistics
import time
import traceback
from unittest import mock

import torch
from gpu_check_cp import SAME_RUNS, STABLE
from gpu_check_phases import train

COMPARABLE = [*SAME_RUNS, *STABLE]
KERNEL_RTOL = 1e-4  # (a) and (b): loss and gradient norm, relative, at every step (module doc)
OFFLOAD_RTOL = 1e-5  # (c): loss, relative, at every step (the offload phase's bound)

SHAPES = {
    "cuda": {
        "llm": {"dim": 1024, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2, "ffn_dim": 2816, "vocab_size": 32000},
        "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_dim": 1408},
        "moe_seq": 1024,
        "docs_seq": 2048,
        "rows": 4,  # rows of seq tokens per step
        "documents": 24,  # packed documents per step: about 4 rows of 2,048 at length_scale 0.25
        "steps": 15,
    },
    "cpu": {
        "llm": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "vocab_size": 384},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 64},
        "moe_seq": 64,
        "docs_seq": 128,
        "rows": 2,
        "documents": 12,
        "steps": 3,
    },
}


def _model(check, name: str, seq: int) -> list[str]:
    shapes = SHAPES[check.device]
    out = [f"model={name}", f"model.seq_len={seq}"] + [f"model.llm.{k}={v}" for k, v in shapes["llm"].items()]
    if name == "llama_moe_tiny":
        out += [f"model.llm.moe.{k}={v}" for k, v in shapes["moe"].items()]
    return out


def _data(check, seq: int, source: str, documents: int) -> list[str]:
    """Synthetic motif documents, one microbatch of ``rows`` rows per step: ``dense`` fills each row with one
    document; ``commoncrawl`` packs long-tailed lengths scaled so the tail starts at half a row."""
    rows = SHAPES[check.device]["rows"]
    return [
        "data=longtail_text",
        f"data.packing.source={source}",
        f"data.packing.documents_per_step={documents}",
        f"data.packing.length_scale={seq / 8192}",
        f"data.packing.tokens_per_microbatch={rows * seq}",
        f"trainer.max_steps={SHAPES[check.device]['steps']}",
    ]


def _curves(metrics: list[dict]) -> dict:
    times = [m["perf/step_time_s"] for m in metrics][2:] or [m["perf/step_time_s"] for m in metrics]
    return {
        "losses": [m["loss"] for m in metrics],
        "grad_norms": [m["grad_norm"] for m in metrics],
        "step_time_s": statistics.median(times),
        "peak_memory_gib": max(m["perf/peak_memory_gib"] for m in metrics),
    }


def _worst(ours: list[float], theirs: list[float]) -> float:
    """The largest relative difference between two curves, step by step (they must have the same steps)."""
    return max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))


def _against(runs: dict, reference: str) -> dict:
    """Each run's curves against ``reference``'s: the worst relative loss and gradient-norm differences."""
    out, ok = {}, True
    for name, run in runs.items():
        if name == reference:
            continue
        loss, norm = (
            _worst(run["losses"], runs[reference]["losses"]),
            _worst(run["grad_norms"], runs[reference]["grad_norms"]),
        )
        out[name] = {"worst_relative_loss_difference": loss, "worst_relative_grad_norm_difference": norm}
        out[name]["step_time_over_reference"] = run["step_time_s"] / runs[reference]["step_time_s"]
        ok &= loss <= KERNEL_RTOL and norm <= KERNEL_RTOL
    return {"ok": ok, "against_" + reference: out}


def _moe(check) -> dict:
    """(a) grouped against loop: the same MoE Llama, seed and motif rows, through train.py (where the device runs
    fp32 grouped matmuls: else moe.experts_kernel=grouped is refused, and auto takes the loop)."""
    from disttrain_core.models.grouped_experts import grouped_available

    if not grouped_available(torch.device(check.device), torch.float32):
        return {"ok": True, "skipped": f"torch._grouped_mm does not run in fp32 on this {check.device} device"}
    seq = SHAPES[check.device]["moe_seq"]
    rows = SHAPES[check.device]["rows"]
    runs, calls = {}, {}
    real = torch._grouped_mm
    for kernel in ("loop", "grouped"):
        count = [0]

        def counted(*args, _count=count, **kwargs):
            _count[0] += 1
            return real(*args, **kwargs)

        overrides = [*_model(check, "llama_moe_tiny", seq), *_data(check, seq, "dense", rows), *COMPARABLE]
        with mock.patch.object(torch, "_grouped_mm", counted):
            metrics = train(check, f"train_paths_moe_{kernel}", [*overrides, f"model.llm.moe.experts_kernel={kernel}"])
        runs[kernel], calls[kernel] = _curves(metrics), count[0]
    compared = _against(runs, "loop")
    ran = calls["grouped"] > 0 and calls["loop"] == 0
    return {**compared, "ok": compared["ok"] and ran, "grouped_mm_calls": calls, **runs}


def _leaky(kernel, q, k, v, documents, gqa):
    """The control's attention: causal over the whole row, across its documents (the fault the mask prevents)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def _documents(check) -> dict:
    """(b) flex (CUDA) and varlen against dense on packed documents, through train.py; and a control: the same run
    with attention leaking across documents must differ from dense by more than the bound (else these data could
    not tell a broken mask from a working one)."""
    seq = SHAPES[check.device]["docs_seq"]
    documents = SHAPES[check.device]["documents"]
    overrides = [*_model(check, "llama_tiny", seq), *_data(check, seq, "commoncrawl", documents), *COMPARABLE]
    kernels = ("dense", "varlen", "flex") if check.cuda else ("dense", "varlen")
    runs = {}
    for kernel in kernels:
        metrics = train(check, f"train_paths_docs_{kernel}", [*overrides, f"model.document_attention={kernel}"])
        runs[kernel] = _curves(metrics)
    compared = _against(runs, "dense")
    with mock.patch("disttrain_core.models.llama.document_attention", _leaky):
        leak = _curves(train(check, "train_paths_docs_leak", [*overrides, "model.document_attention=dense"]))
    control = _against({"dense": runs["dense"], "leak": leak}, "dense")["against_dense"]["leak"]
    detected = max(control["worst_relative_loss_difference"], control["worst_relative_grad_norm_difference"])
    skipped = {} if check.cuda else {"flex": "not run: training refuses flex off CUDA (no FlexAttention backward)"}
    return {
        **compared,
        "ok": compared["ok"] and detected > KERNEL_RTOL,
        "leak_control": control,
        **runs,
        **skipped,
        "documents_per_step": documents,
        "seq_len": seq,
    }


def _offload_overrides(check, offload: bool) -> list[str]:
    seq = SHAPES[check.device]["moe_seq"]
    return [
        *_model(check, "llama_tiny", seq),
        "parallel=dp",
        "parallel.shard=zero3",
        f"parallel.offload={'optimizer' if offload else 'none'}",
        *STABLE,
    ]


def _train_py_refusal(check) -> str:
    """What train.py says to FSDP2 with offload on one rank ('' when it trains it: then this phase can run it)."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            seq, rows = SHAPES[check.device]["moe_seq"], SHAPES[check.device]["rows"]
            overrides = [*_offload_overrides(check, True), *_data(check, seq, "dense", rows), *SAME_RUNS]
            train(check, "train_paths_fsdp_train_py", overrides)
    except SystemExit:
        return said.getvalue().strip()
    return ""


def _fsdp_run(check, offload: bool) -> dict:
    """One rank's zero3 stage built as the units engine builds it (unit_engine.py ``_build_stages``), trained
    ``steps`` steps by ``ShardedOptimizer`` on motif rows; its losses, step time and the device's peak."""
    from torch.distributed.device_mesh import init_device_mesh

    from disttrain_core.config import compose
    from disttrain_core.data.batch import text_rows
    from disttrain_core.data.packed_loader import synthetic_document
    from disttrain_core.data.tokenizer import tokenizer_for
    from disttrain_core.parallel.fsdp import ShardedOptimizer, apply_fsdp
    from disttrain_core.parallel.plan import build_pipeline, units_of
    from disttrain_core.parallel.stages import build_rank_stages
    from disttrain_core.train.unit_engine import wire_dtype

    where = [f"trainer.accelerator={check.device}", f"paths.output_dir={check.scratch / 'train_paths_fsdp'}"]
    cfg = compose([*_offload_overrides(check, offload), *where])
    layout = units_of(cfg)
    unit = layout.llm
    host = unit.fsdp and unit.offload == "optimizer"  # what _build_stages reads
    schedule, _, rows_of_units = build_pipeline(cfg, layout, 1)
    device, mesh = torch.device(check.device), init_device_mesh(check.device, (1,))

    def shard(module):
        apply_fsdp(module, mesh, unit.shard, wire_dtype(cfg, device.type), None, offload=host)

    if check.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    rows = rows_of_units[unit.name]
    stages = build_rank_stages(
        cfg.model, tokenizer_for(cfg), unit, schedule, rows, rows[0], device, cfg.trainer.seed, shard=shard,
        param_device=torch.device("cpu") if host else None,
    )  # fmt: skip
    stage = next(iter(stages.values()))
    optimizer = ShardedOptimizer(list(stage.model.named_parameters()), cfg.optim, copies=1, device=device)
    generator = torch.Generator().manual_seed(0)
    vocab, seq, count = int(cfg.model.llm.vocab_size), int(cfg.model.seq_len), SHAPES[check.device]["rows"]
    losses, times = [], []
    for _ in range(SHAPES[check.device]["steps"]):
        tokens = torch.stack([synthetic_document(seq + 1, vocab, generator) for _ in range(count)]).to(device)
        started = time.perf_counter()
        out = stage(None, text_rows(tokens[:, :-1], tokens[:, 1:]))
        loss = sum(out.loss_sums.values()) / (count * seq)
        loss.backward()
        optimizer.reduce_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # waits for the step
        times.append(time.perf_counter() - started)
    on_host = all(getattr(p, "_local_tensor", p).device.type == "cpu" for p in stage.parameters())
    peak = torch.cuda.max_memory_allocated() if check.cuda else None
    return {
        "losses": losses,
        "step_time_s": statistics.median(times[2:] or times),
        "peak_bytes": peak,
        "params_on_host": on_host,
    }


def _init_draws_differ(check) -> bool:
    """Whether the runtime's seeded init writes other values into a host tensor than into one on the device."""
    from disttrain_core.models.common import _seeded_normal_into

    shape = torch.Size([64, 64])
    host, device = torch.empty(shape), torch.empty(shape, device=check.device)
    for target in (host, device):
        _seeded_normal_into(target, shape, (0, 0), 0.02, 1)
    return not torch.equal(host, device.cpu())


def _fsdp_offload(check) -> dict:
    """(c) FSDP2 zero3 with CPUOffloadPolicy against without, one rank, from the same initial weights (module
    doc)."""
    import torch.distributed as dist

    from disttrain_core.models import common

    refusal = _train_py_refusal(check)
    torch.use_deterministic_algorithms(True)  # as the pairs' train.py runs (SAME_RUNS), and no TF32 (STABLE)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    backend = "nccl" if check.cuda else "gloo"
    store = dist.FileStore(str(check.scratch / "train_paths_fsdp_store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        draw = common._seeded_normal_into

        def host_draw(*args, **kwargs):  # on the host generator wherever the parameters live (module doc)
            return draw(*args, **{**kwargs, "on_device": False})

        with mock.patch.object(common, "_seeded_normal_into", host_draw):
            runs = {name: _fsdp_run(check, name == "offload") for name in ("device", "offload")}
    finally:
        dist.destroy_process_group()
    worst = _worst(runs["offload"]["losses"], runs["device"]["losses"])
    placed = runs["offload"]["params_on_host"] and (not check.cuda or not runs["device"]["params_on_host"])
    lower = not check.cuda or runs["offload"]["peak_bytes"] < runs["device"]["peak_bytes"]
    return {
        "ok": worst <= OFFLOAD_RTOL and placed and lower,
        "train_py_refuses": refusal,
        "ran": f"the runtime's FSDP2 stage and ShardedOptimizer on a one-rank {backend} group",
        "initial_weights": "both drawn on the host generator",
        "runtime_init_differs_host_vs_device": _init_draws_differ(check),
        "peak_measured": check.cuda,
        "worst_relative_loss_difference": worst,
        **runs,
    }


def _guarded(part, check) -> dict:
    """A sub-check's result, or its error (the other sub-checks still run and report), and its seconds."""
    started = time.perf_counter()
    try:
        result = part(check)
    except (Exception, SystemExit) as error:
        result = {"ok": False, "error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-3000:]}
    return {**result, "seconds": round(time.perf_counter() - started, 2)}


def phase_train_paths(check) -> dict:
    """Grouped MoE experts, packed-document attention and FSDP2's CPU offload in training (module doc)."""
    parts = {"moe_experts": _moe, "document_attention": _documents, "fsdp2_cpu_offload": _fsdp_offload}
    results = {name: _guarded(part, check) for name, part in parts.items()}
    return {"ok": all(r["ok"] for r in results.values()), **results}
