"""tools/gpu_check.py device=cpu: every phase of the one-GPU check runs with tiny shapes here, so the check the
first GPU runs cannot rot (issue 36)."""

import json
import subprocess
import sys

from ..conftest import REPO, run_script


def test_every_phase_of_the_gpu_check_passes_with_tiny_shapes_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = run_script(REPO / "tools" / "gpu_check.py", ["device=cpu", f"out={out}"], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    phases = report["phases"]
    assert set(phases) == {
        "api",
        "host_syncs",
        "ring_attention",
        "cp_modes",
        "offload",
        "act_offload",
        "throughput_and_compile",
        "recompute_memory",
        "fsdp2_async_dcp",
        "fsdp_bf16",
        "weight_materialization",
        "float8",
        "fast_paths",
        "train_paths",
    }
    assert all(phase["ok"] for phase in phases.values()) and report["passed"] and report["complete"]
    assert phases["ring_attention"]["memory_at_recipe_block"]["ratio"] <= 2.0
    assert phases["fsdp2_async_dcp"]["max_abs_difference"] == 0.0
    assert phases["fsdp_bf16"]["kept_block_dtype"] == "torch.bfloat16"
    assert phases["act_offload"]["worst_relative_loss_difference"] == 0.0  # deterministic: the same bytes back
    assert set(phases["fast_paths"]["document_attention"]) >= {"ok", "fp32 dense", "fp32 varlen", "bf16 varlen"}
    assert "model.float8=tensorwise runs FP8 matmuls on NVIDIA GPUs" in phases["float8"]["refused"]
    paths = phases["train_paths"]
    calls = paths["moe_experts"]["grouped_mm_calls"]
    assert calls["grouped"] > 0 and calls["loop"] == 0
    assert set(paths["document_attention"]["against_dense"]) == {"varlen"}  # flex trains on CUDA only
    assert "zero3" in paths["fsdp2_cpu_offload"]["train_py_refuses"]  # one rank: the runtime's pieces run it


def test_without_a_gpu_the_default_device_says_what_to_type_instead():
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gpu_check.py")], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    import torch

    if torch.cuda.is_available():
        return
    assert result.returncode == 2 and "device=cpu" in result.stderr and len(result.stderr.strip().splitlines()) == 1
