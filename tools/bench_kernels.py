"""Fast paths against the plain ones on this CPU (issue 39; docs/performance/kernels.md).

Built so far: **(a) the LM head and its loss**, plain (``model.loss_chunk=0``: the whole microbatch's logits at
once) against chunks of ``chunks`` positions (models/chunked_loss.py). For ``model=llama_tiny`` with a
``vocab``-token vocabulary and rows of ``positions`` tokens (``rows`` per microbatch), each setting runs the
model's forward and backward ``repeats`` times, alternating settings: the peak live tensor bytes of a step (the
allocator's events through torch.profiler, train/memory_report.py) and the time of a step (median and spread
over the repeats). The full fp32 logits' size is printed beside the saving. **(b) MoE experts**: one MoE layer
(``experts`` SwiGLU experts of width ``expert_ffn`` on ``dim``, top-2, ``tokens`` tokens) forward and backward
with ``moe.experts_kernel=grouped`` (torch._grouped_mm, no host sync) against ``loop`` (a matmul per expert),
fp32, alternating, median and spread. **(c) packed-document attention**: one attention call (q/k/v of ``heads``
heads of 64 on rows of ``positions`` tokens holding documents of ``doc_lengths``) forward and backward,
``model.document_attention=dense`` (an [S, S] mask) against ``varlen`` (one causal SDPA per document), and the
same under context parallelism (``cp2_*``: ring attention at cp=2, both ranks emulated in this process; the
per-block mask against the same-document runs, comm/ring_documents.py): time and peak live bytes.
**(d) trainer.compile against eager** engine by engine (``compile_layouts``: the DDP engine, a pipeline, a
disaggregated layout, FSDP2; tools/bench_compile.py, whose options ``compile_steps``, ``compile_window`` and
``compile_repeats`` are passed on): tokens/s per round, the ratio's median and range.
``compile_layouts=`` (empty) skips it.

    python tools/bench_kernels.py                         # about a minute here, plus (d): about 10 minutes
    python tools/bench_kernels.py vocab=32768 positions=2048 chunks=0,256,1024 format=json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from disttrain_core.config import REPO_ROOT
from disttrain_core.launch.cli import tool_main, tool_options

OPTIONS = {
    "vocab": "32768",
    "positions": "2048",
    "rows": "1",
    "chunks": "0,256,1024",  # 0: the plain head
    "repeats": "3",
    "experts": "8",
    "dim": "256",
    "expert_ffn": "512",
    "tokens": "4096",
    "heads": "8",
    "doc_lengths": "1024,512,256,128,64,64",  # one row's documents (positions: their sum)
    "compile_layouts": "ddp,pp2,disagg2,fsdp2",  # (d); empty: skip
    "compile_steps": "16",
    "compile_window": "4",
    "compile_repeats": "3",
    "format": "table",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_kernels.json"),
}


def _model(vocab: int, positions: int, chunk: int):
    from disttrain_core.config import compose
    from disttrain_core.data.tokenizer import ByteTokenizer
    from disttrain_core.models import build_model, materialize

    cfg = compose(
        ["model=llama_tiny", f"model.llm.vocab_size={vocab}", f"model.seq_len={positions}", f"model.loss_chunk={chunk}"]
    ).model
    model = build_model(cfg, ByteTokenizer(), device="meta")
    materialize(model, "cpu", seed=0, std=cfg.init_std)
    return model


def _step(model, tokens) -> None:
    llm = model.llm
    hidden = llm.final_norm(llm.run_layers(llm.embed(tokens)))
    model.lm_loss_sum(hidden, tokens.roll(-1, dims=1)).backward()


def loss_head(options: dict) -> list[dict]:
    import torch

    from disttrain_core.train.memory_report import allocation_peak

    vocab, positions, rows = int(options["vocab"]), int(options["positions"]), int(options["rows"])
    chunks = [int(c) for c in options["chunks"].split(",")]
    models = {c: _model(vocab, positions, c) for c in chunks}
    tokens = torch.randint(0, vocab, (rows, positions), generator=torch.Generator().manual_seed(0))
    peaks: dict[int, list[int]] = {c: [] for c in chunks}
    times: dict[int, list[float]] = {c: [] for c in chunks}
    for c in chunks:  # one step each first: allocator warm-up
        _step(models[c], tokens)
    for _ in range(int(options["repeats"])):
        for c in chunks:  # alternating
            result: dict = {}
            started = time.perf_counter()
            with allocation_peak(result):
                _step(models[c], tokens)
            times[c].append(time.perf_counter() - started)
            peaks[c].append(result["peak_delta"])
            models[c].zero_grad(set_to_none=True)
    logits = rows * positions * vocab * 4
    plain = statistics.median(peaks[chunks[0]])
    return [
        {
            "loss_chunk": c,
            "peak_bytes_median": statistics.median(peaks[c]),
            "peak_bytes_range": [min(peaks[c]), max(peaks[c])],
            "step_s_median": statistics.median(times[c]),
            "step_s_range": [min(times[c]), max(times[c])],
            "peak_saved_bytes": plain - statistics.median(peaks[c]),
            "full_fp32_logits_bytes": logits,
        }
        for c in chunks
    ]


def moe_experts(options: dict) -> list[dict]:
    import torch

    from disttrain_core.config.model import MoeConfig
    from disttrain_core.models.common import init_weights
    from disttrain_core.models.moe import MoeFeedForward

    dim, tokens = int(options["dim"]), int(options["tokens"])
    layers = {}
    for kernel in ("loop", "grouped"):
        cfg = MoeConfig(num_experts=int(options["experts"]), top_k=2, expert_ffn_dim=int(options["expert_ffn"]))
        cfg.experts_kernel = kernel
        layers[kernel] = MoeFeedForward(dim, cfg, int(options["expert_ffn"]))
        init_weights(layers[kernel], 0, std=0.02)
    x = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {k: [] for k in layers}
    for _ in range(int(options["repeats"]) + 1):  # the first round warms up
        for kernel, layer in layers.items():
            started = time.perf_counter()
            layer(x.requires_grad_()).backward(grad)
            times[kernel].append(time.perf_counter() - started)
            layer.zero_grad(set_to_none=True)
    loop = statistics.median(times["loop"][1:])
    return [
        {
            "experts_kernel": kernel,
            "step_s_median": statistics.median(t[1:]),
            "step_s_range": [min(t[1:]), max(t[1:])],
            "against_loop": statistics.median(t[1:]) / loop,
        }
        for kernel, t in times.items()
    ]


def packed_attention(options: dict) -> list[dict]:
    import torch

    from disttrain_core.comm.ring_attention import emulated_ring_attention
    from disttrain_core.models.document_attention import dense_attention, segments_of, varlen_attention
    from disttrain_core.train.memory_report import allocation_peak

    lengths = [int(n) for n in options["doc_lengths"].split(",")]
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].expand(2, -1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, int(options["heads"]), ids.shape[1], 64, generator=g) for _ in range(3))
    kernels = {
        "dense": lambda a, b, c: dense_attention(a, b, c, ids, False),
        "varlen": lambda a, b, c: varlen_attention(a, b, c, segments_of(ids), False),
        # context parallelism's ring, both ranks of cp=2 in this process (comm/ring_documents.py)
        "cp2_dense": lambda a, b, c: emulated_ring_attention(a, b, c, 2, doc_ids=ids, doc_kernel="dense"),
        "cp2_varlen": lambda a, b, c: emulated_ring_attention(a, b, c, 2, doc_ids=ids, doc_kernel="varlen"),
    }
    times: dict[str, list[float]] = {k: [] for k in kernels}
    peaks: dict[str, list[int]] = {k: [] for k in kernels}
    for round_ in range(int(options["repeats"]) + 1):  # the first round warms up
        for name, fn in kernels.items():
            tensors = [t.clone().requires_grad_() for t in (q, k, v)]
            result: dict = {}
            started = time.perf_counter()
            with allocation_peak(result):
                fn(*tensors).sum().backward()
            if round_:
                times[name].append(time.perf_counter() - started)
                peaks[name].append(result["peak_delta"])
    return [
        {
            "document_attention": name,
            "positions": int(ids.shape[1]),
            "documents": len(lengths),
            "step_s_median": statistics.median(times[name]),
            "step_s_range": [min(times[name]), max(times[name])],
            # against the dense mask of the same path (one call, or the ring's per-block mask)
            "against_dense": statistics.median(times[name]) / statistics.median(times[name.replace("varlen", "dense")]),
            "peak_bytes_median": statistics.median(peaks[name]),
        }
        for name in kernels
    ]


def main(argv: list[str]) -> int:
    options = tool_options(argv, OPTIONS)
    rows = loss_head(options)
    experts = moe_experts(options)
    attention = packed_attention(options)
    compiled = []
    if options["compile_layouts"]:
        from bench_compile import compiled_engines  # tools/bench_compile.py, beside this file

        compiled = compiled_engines(
            {
                "layouts": options["compile_layouts"],
                "steps": options["compile_steps"],
                "window": options["compile_window"],
                "repeats": options["compile_repeats"],
            }
        )
    result = {
        "options": options,
        "loss_head": rows,
        "moe_experts": experts,
        "packed_attention": attention,
        "compiled_engines": compiled,
    }
    out = Path(options["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if options["format"] == "json":
        print(json.dumps(result, indent=1))
        return 0
    base = rows[0]
    for row in rows:
        print(
            f"loss_chunk={row['loss_chunk']}: peak {row['peak_bytes_median'] / 1e6:,.0f} MB "
            f"({row['peak_saved_bytes'] / 1e6:,.0f} MB less than loss_chunk={base['loss_chunk']}; the full fp32 logits "
            f"are {row['full_fp32_logits_bytes'] / 1e6:,.0f} MB), step {row['step_s_median']:.3f} s "
            f"({row['step_s_range'][0]:.3f}-{row['step_s_range'][1]:.3f}; "
            f"{row['step_s_median'] / base['step_s_median']:.2f}x)"
        )
    for row in experts:
        print(
            f"experts_kernel={row['experts_kernel']}: {row['step_s_median'] * 1e3:.1f} ms forward+backward "
            f"({row['step_s_range'][0] * 1e3:.1f}-{row['step_s_range'][1] * 1e3:.1f}; {row['against_loop']:.2f}x loop)"
        )
    for row in attention:
        print(
            f"document_attention={row['document_attention']}: {row['step_s_median'] * 1e3:.1f} ms forward+backward "
            f"({row['step_s_range'][0] * 1e3:.1f}-{row['step_s_range'][1] * 1e3:.1f}; {row['against_dense']:.2f}x "
            f"dense), peak {row['peak_bytes_median'] / 1e6:,.1f} MB"
        )
    if compiled:
        from bench_compile import describe

        print("\n".join(describe(compiled)))
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
