"""Every CUDA path one GPU can reach, in one command: a PASS/FAIL table and a JSON of the numbers.

    python tools/gpu_check.py                    # on a CUDA machine (about 5 minutes on one H200)
    python tools/gpu_check.py device=cpu         # every phase with tiny shapes on the CPU (make test runs it)
    python tools/gpu_check.py phases=api,ring_attention out=/tmp/gpu_check.json

Phases (tools/gpu_check_phases.py): the torch APIs the project relies on; host-sync checking
(trainer.sync_debug=error) through the DDP engine, the units engine and the multimodal model in bf16; ring
attention's numerics against SDPA (context parallelism emulated inside one process) and its memory at the 128K
recipe's block size; throughput and MFU of a ~1B Llama in bf16 against a plain PyTorch loop of the same model,
and trainer.compile=true against eager; peak memory of no / full / selective recompute against the memory model;
FSDP2 and asynchronous DCP save/load on a one-rank NCCL group; FSDP2 with bf16 parameters training the Llama on a
one-rank NCCL group, its peak memory against the memory model's prediction; weight materialization time; FP8
(model.float8) against bf16 over 50 compiled steps, or its one-line refusal without FP8 tensor cores; the context-
parallel modes emulated; activation and optimizer offload against the runs without; grouped MoE experts and
packed-document attention kernels against their plain paths, as single layers and in short training runs, and
FSDP2's CPU offload on a one-rank NCCL group against the run without (train_paths). About 5 minutes on one H200
(docs/GPU.md). On a machine with torch but no package index, see docs/GPU.md (tools/prepare_wheels.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_cp import phase_act_offload, phase_cp_modes, phase_offload  # noqa: E402
from gpu_check_fast_paths import phase_fast_paths  # noqa: E402
from gpu_check_float8 import phase_float8  # noqa: E402
from gpu_check_fsdp_bf16 import phase_fsdp_bf16  # noqa: E402
from gpu_check_phases import PHASES, Check  # noqa: E402
from gpu_check_train_paths import phase_train_paths  # noqa: E402

# tools/gpu_check_float8.py, tools/gpu_check_fsdp_bf16.py, tools/gpu_check_cp.py, tools/gpu_check_fast_paths.py,
# tools/gpu_check_train_paths.py
PHASES = {
    **PHASES,
    "fsdp_bf16": phase_fsdp_bf16,
    "float8": phase_float8,
    "cp_modes": phase_cp_modes,
    "offload": phase_offload,
    "act_offload": phase_act_offload,
    "fast_paths": phase_fast_paths,
    "train_paths": phase_train_paths,
}

from disttrain_core.config import REPO_ROOT  # noqa: E402
from disttrain_core.launch.cli import tool_main, tool_options  # noqa: E402

OPTIONS = {"device": "cuda", "phases": "all", "out": "", "format": "table"}

# ~1B Llama-shaped model on a GPU (Llama-3.2-1B's width and depth, a 32K vocabulary), tiny on the CPU
SHAPES = {
    "cuda": {
        "llama": {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 8192, "vocab_size": 32000},
        "seq_len": 2048,
        "micro_batch": 4,
        "steps": 20,
        "window": 10,
        "ring": {"heads": 8, "kv_heads": 2, "head_dim": 128, "seq": 1024, "block": 8192},
    },
    "cpu": {
        "llama": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "vocab_size": 384},
        "seq_len": 64,
        "micro_batch": 2,
        "steps": 4,
        "window": 2,
        "ring": {"heads": 4, "kv_heads": 2, "head_dim": 16, "seq": 48, "block": 256},
    },
}


def recipe_block() -> int:
    """Positions per rank of recipes/llama3_8b_128k_cp.yaml (its sequence over its context-parallel ranks)."""
    from disttrain_core.config import compose

    cfg = compose(["recipe=llama3_8b_128k_cp", "data.path=unused.npy"])
    return int(cfg.model.seq_len) // int(cfg.parallel.cp)


def run(device: str, names: list[str], scratch: Path, save=lambda results: None) -> dict:
    """Each phase in turn; ``save`` gets the results so far after each one (a run cut off by a timeout still
    leaves the phases it finished)."""
    shapes = dict(SHAPES[device])
    if device == "cuda":
        shapes["ring"] = {**shapes["ring"], "block": recipe_block()}
    check = Check(device=device, scratch=scratch, **shapes)
    results = {}
    for name in names:
        torch_defaults()
        started = time.perf_counter()
        try:
            result = PHASES[name](check)
        except (Exception, SystemExit) as error:  # a failing phase (launch exits on a bad run) is reported
            result = {"ok": False, "error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - started, 2)
        results[name] = result
        print(f"{'PASS' if result['ok'] else 'FAIL'}  {name:24s} {result['seconds']:7.1f} s", flush=True)
        save(results)
    return results


def torch_defaults() -> None:
    """Each phase starts from torch's process-wide defaults: a train.py run sets TF32 and determinism for its
    process (launch/worker.py ``configure_device``) and leaves them set, and on the first H200 run a later phase's
    fp32 attention inherited TF32 matmuls from the runs before it."""
    torch.use_deterministic_algorithms(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True


def machine(device: str) -> dict:
    info = {"torch": torch.__version__, "device": device, "python": sys.version.split()[0]}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
        info["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


def main(argv: list[str]) -> int:
    options = tool_options(argv, OPTIONS)
    device = options["device"]
    if device not in SHAPES:
        print(f"error: device={device!r}: use cuda or cpu", file=sys.stderr)
        return 2
    if device == "cuda" and not torch.cuda.is_available():
        print(
            "error: no CUDA device here; python tools/gpu_check.py device=cpu runs every phase with tiny shapes on "
            "the CPU",
            file=sys.stderr,
        )
        return 2
    names = list(PHASES) if options["phases"] == "all" else options["phases"].split(",")
    unknown = [n for n in names if n not in PHASES]
    if unknown:
        print(f"error: phases={options['phases']}: unknown {unknown}; allowed: {', '.join(PHASES)}", file=sys.stderr)
        return 2
    if device == "cuda":  # before cuBLAS starts: the deterministic phases' runs need it (launch/worker.py)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    logging.getLogger("disttrain").setLevel(logging.WARNING)  # the table is the output
    out = Path(options["out"] or REPO_ROOT / "outputs" / f"gpu_check_{device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    about = machine(device)

    def save(results: dict) -> dict:
        report = {"machine": about, "phases": results, "passed": all(r["ok"] for r in results.values())}
        report["complete"] = len(results) == len(names)
        out.write_text(json.dumps(report, indent=1, default=str))
        return report

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        report = save(run(device, names, Path(tmp), save))
    if options["format"] == "json":
        print(json.dumps(report, indent=1, default=str))
    passed = sum(r["ok"] for r in report["phases"].values())
    print(f"{'PASS' if report['passed'] else 'FAIL'}: {passed}/{len(names)} phases; {out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(tool_main(main, sys.argv[1:]))
