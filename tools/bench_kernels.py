"""Fast paths against the plain ones on this CPU (issue 39; docs/PERFORMANCE.md).

Built so far: **(a) the LM head and its loss**, plain (``model.loss_chunk=0``: the whole microbatch's logits at
once) against chunks of ``chunks`` positions (models/chunked_loss.py). For ``model=llama_tiny`` with a
``vocab``-token vocabulary and rows of ``positions`` tokens (``rows`` per microbatch), each setting runs the
model's forward and backward ``repeats`` times, alternating settings: the peak live tensor bytes of a step (the
allocator's events through torch.profiler, train/memory_report.py) and the time of a step (median and spread
over the repeats). The full fp32 logits' size is printed beside the saving. Compiled against eager engines,
block-mask against dense-mask attention: not built yet (issue 39).

    python tools/bench_kernels.py                         # about a minute here
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


def main(argv: list[str]) -> int:
    options = tool_options(argv, OPTIONS)
    rows = loss_head(options)
    result = {"options": options, "loss_head": rows}
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
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
