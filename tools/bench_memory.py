"""Predicted against measured memory per rank, for six layouts (issue 13; docs/performance/memory.md).

Each layout trains ``steps`` optimizer steps with ``trainer.memory_report_step`` on the last one: every
rank writes its counted model state, its peak live tensor bytes during that step (the allocator's
events through torch.profiler: train/memory_report.py) and its RSS, beside the planner's prediction for
its role (planner/breakdown.py: the numbers tools/memory.py prints). The models are large enough that
states and activations are most of each process's resident memory (``tensor_share`` = measured peak /
the resident set's high-water mark, with glibc serving large blocks from mmap so freed tensors leave
the resident set), so the comparison is about the tensors, not the Python runtime.

    python tools/bench_memory.py                      # ~10 minutes on 2 cores, fp32
    python tools/bench_memory.py layouts=ddp,zero3 format=json

Writes ``out`` (default docs/results/bench_memory.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from disttrain_core.config import REPO_ROOT
from disttrain_core.launch.cli import split_tool_args

OPTIONS = {
    "steps": "2",
    "layouts": "",
    "format": "text",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_memory.json"),
}

# A 16-layer, 1024-wide Llama (about 190 M parameters, ~3 GB of fp32 model state without sharding).
LLAMA = [
    "model=llama_tiny",
    "model.llm.dim=1024",
    "model.llm.n_layers=16",
    "model.llm.n_heads=16",
    "model.llm.n_kv_heads=4",
    "model.llm.ffn_dim=2816",
    "model.llm.vocab_size=384",
]
# The multimodal model with a ViT-B-sized encoder and a wider LLM, for the disaggregated layout.
MLLM = [
    "model=mllm_tiny",
    "model.encoder.dim=768",
    "model.encoder.n_layers=12",
    "model.encoder.n_heads=12",
    "model.encoder.mlp_dim=3072",
    "model.llm.dim=1024",
    "model.llm.n_layers=12",
    "model.llm.n_heads=16",
    "model.llm.n_kv_heads=4",
    "model.llm.ffn_dim=2816",
]
BATCH = ["optim.global_batch_size=4", "optim.micro_batch_size=2"]
LAYOUTS = {
    "ddp": [*LLAMA, "parallel=dp", "trainer.devices=2", "parallel.shard=none"],
    "zero1": [*LLAMA, "parallel=dp", "trainer.devices=2", "parallel.shard=zero1"],
    "zero3": [*LLAMA, "parallel=dp", "trainer.devices=2", "parallel.shard=zero3"],
    "recompute_full": [*LLAMA, "parallel=dp", "trainer.devices=2", "parallel.shard=zero1", "parallel.recompute=full"],
    "pipeline_1f1b": [*LLAMA, "parallel=pp2", "trainer.devices=2", "schedule=1f1b", "optim.global_batch_size=8"],
    "disaggregated": [*MLLM, "parallel=disagg2"],
}


def run(name: str, overrides: list[str], steps: int, data: Path, work: Path) -> dict:
    run_dir = work / name
    args = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        f"hydra.run.dir={run_dir}",
        f"data.path={data}",
        *BATCH,
        *overrides,
        "trainer.precision=32",
        f"trainer.max_steps={steps}",
        f"trainer.memory_report_step={steps}",
        "trainer.checkpoint.every_n_steps=0",
        "trainer.checkpoint.save_last=false",
        "trainer.progress_bar=false",
        "cluster.peak_flops_fp32=1e11",
    ]
    # Large blocks straight from mmap (returned to the OS on free): otherwise glibc keeps freed tensors'
    # pages (FSDP2's gathered parameters, activations) and the resident set says more about the C
    # allocator's cache than about what training holds.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT, timeout=3600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")
    ranks = []
    for path in sorted((run_dir / "memory").glob("rank*.json")):
        report = json.loads(path.read_text())
        measured, predicted = report["measured"], report["predicted"]
        ranks.append(
            {
                "rank": int(path.stem[4:]),
                "role": f"{predicted['unit']} pp{predicted['pp']}",
                "shard": predicted["shard"],
                "recompute": predicted["recompute"],
                "state_counted": measured["state"]["total"],
                "state_predicted": predicted["state"]["total"],
                "peak_measured": measured["peak"],
                "peak_predicted": predicted["peak"],
                "error": predicted["peak"] / measured["peak"] - 1.0,
                "rss_peak": measured["rss_peak"],
                "tensor_share": measured["peak"] / measured["rss_peak"],
            }
        )
    return {"layout": name, "overrides": overrides, "layout_text": report["layout"], "ranks": ranks}


def main(argv: list[str]) -> int:
    options, extra = split_tool_args(argv, OPTIONS)
    names = [n for n in options["layouts"].split(",") if n] or list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"error: layouts={unknown}: choose from {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    from disttrain_core.config import SyntheticDataConfig
    from disttrain_core.data.synthetic import generate_shards

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "shards"
        generate_shards(SyntheticDataConfig(num_shards=2, samples_per_shard=32, image_side_max=128), data, processes=1)
        for name in names:
            print(f"[{len(results) + 1}/{len(names)}] {name} ...", file=sys.stderr, flush=True)
            results.append(run(name, LAYOUTS[name] + extra, int(options["steps"]), data, work))
    worst = max(abs(r["error"]) for result in results for r in result["ranks"])
    summary = {"results": results, "worst_peak_error": worst, "precision": "32", "steps": int(options["steps"])}
    Path(options["out"]).parent.mkdir(parents=True, exist_ok=True)
    Path(options["out"]).write_text(json.dumps(summary, indent=1))
    if options["format"] == "json":
        print(json.dumps(summary))
        return 0
    print(
        f"{'layout':16s} {'rank role':14s} {'state (counted / model)':>26s} {'peak (measured / model)':>26s} "
        f"{'error':>7s} {'peak RSS':>9s} {'tensors/RSS':>11s}"
    )
    for result in results:
        for r in result["ranks"]:
            state = f"{r['state_counted'] / 1e6:11.1f} / {r['state_predicted'] / 1e6:8.1f} MB"
            print(
                f"{result['layout']:16s} {r['role']:14s} {state}"
                f" {r['peak_measured'] / 1e6:11.1f} / {r['peak_predicted'] / 1e6:8.1f} MB {r['error']:+7.1%}"
                f" {r['rss_peak'] / 1e6:7.0f}MB {r['tensor_share']:10.0%}"
            )
    print(f"worst peak error {worst:.1%}; written to {options['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
