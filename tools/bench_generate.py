"""Time per generated token against position, with the KV cache and without it (models/generation.py).

    python tools/bench_generate.py                                   # llama_tiny, positions to 528, CPU
    python tools/bench_generate.py model=llama_small device=cuda out=/tmp/generate.json

One row of one prompt token, then one token at a time up to ``positions``: the median seconds of the 32 tokens
around position 64 and around 512 (``near`` below), with the cache (one position through the blocks each) and
without it (the whole prefix again each time, stopped after ``uncached_to`` positions: its cost grows with the
row). Random weights: the time does not depend on what the tokens are. Writes docs/results/bench_generate.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from disttrain_core.config import REPO_ROOT
from disttrain_core.launch.cli import tool_main, tool_options

OPTIONS = {
    "model": "llama_tiny",
    "positions": "528",
    "uncached_to": "528",
    "device": "cpu",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_generate.json"),
}
NEAR = (64, 512)


def _times(llm, positions: int, cached: bool, device) -> dict[int, float]:
    from disttrain_core.models.generation import KVCache, _uncached_last

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    token = torch.tensor([[65]], device=device)
    rows = token
    kv = KVCache(llm, positions + 1) if cached else None
    times = {}
    with torch.no_grad():
        if kv is not None:
            kv.forward(llm, token)
        for position in range(1, positions):
            sync()
            started = time.perf_counter()
            if kv is not None:
                kv.forward(llm, token)
            else:
                rows = torch.cat([rows, token], dim=1)
                _uncached_last(llm, rows)
            sync()
            times[position] = time.perf_counter() - started
    return times


def main(argv: list[str]) -> int:
    from disttrain_core.config import compose
    from disttrain_core.data.tokenizer import ByteTokenizer
    from disttrain_core.models import build_model, materialize

    options = tool_options(argv, OPTIONS)
    device = torch.device(options["device"])
    positions, uncached_to = int(options["positions"]), int(options["uncached_to"])
    cfg = compose([f"model={options['model']}", "data.path=unused"])
    model = build_model(cfg.model, ByteTokenizer(), device="meta")
    materialize(model, device, seed=0, std=0.02)
    llm = model.llm.eval()
    result = {"model": options["model"], "device": str(device), "torch": torch.__version__, "near": list(NEAR)}
    for name, cached, stop in (("cache", True, positions), ("no_cache", False, uncached_to)):
        times = _times(llm, stop, cached, device)
        medians = {str(p): statistics.median(times[i] for i in range(p - 16, p + 16)) for p in NEAR if p + 16 <= stop}
        result[name] = {"median_seconds_per_token": medians}
        if len(medians) == 2:
            result[name]["ratio_512_over_64"] = medians["512"] / medians["64"]
        print(name, {k: f"{v * 1e3:.3f} ms" for k, v in medians.items()}, flush=True)
    out = Path(options["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k in ("cache", "no_cache")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(tool_main(main, sys.argv[1:]))
