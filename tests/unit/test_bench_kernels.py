"""tools/bench_kernels.py (issue 39, its first parts): the plain head against chunks (peak bytes and times), and
grouped expert matmuls against the per-expert loop, and packed-document attention without the dense mask."""

import json

from ..conftest import REPO, run_script

TOOL = REPO / "tools" / "bench_kernels.py"


def test_chunks_lower_the_peak_and_the_report_keeps_its_spread(tmp_path):
    out = tmp_path / "kernels.json"
    moe = ["experts=4", "dim=64", "expert_ffn=64", "tokens=256", "heads=2", "doc_lengths=64,32,32"]
    # (d) compiled engines: tools/bench_compile.py, run by hand (about 10 minutes); its options below
    args = ["vocab=8192", "positions=512", "chunks=0,128", "repeats=2", *moe, "compile_layouts=", f"out={out}"]
    result = run_script(TOOL, args, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    plain, chunked = report["loss_head"]
    assert (plain["loss_chunk"], chunked["loss_chunk"]) == (0, 128)
    assert chunked["peak_saved_bytes"] >= plain["full_fp32_logits_bytes"] == 512 * 8192 * 4
    low, high = chunked["step_s_range"]
    assert low <= chunked["step_s_median"] <= high
    loop, grouped = report["moe_experts"]
    assert (loop["experts_kernel"], grouped["experts_kernel"]) == ("loop", "grouped") and loop["against_loop"] == 1
    dense, varlen, ring_dense, ring_varlen = report["packed_attention"]
    assert (dense["document_attention"], varlen["document_attention"]) == ("dense", "varlen")
    assert (ring_dense["document_attention"], ring_varlen["document_attention"]) == ("cp2_dense", "cp2_varlen")
    assert varlen["positions"] == 128 and varlen["documents"] == 3 and varlen["peak_bytes_median"] > 0
    assert ring_dense["against_dense"] == 1 and ring_varlen["peak_bytes_median"] > 0


def test_bench_compile_names_an_unknown_layout_and_its_choices():
    result = run_script(REPO / "tools" / "bench_compile.py", ["layouts=ddp,tp8"], timeout=60)
    assert result.returncode == 2 and "unknown ['tp8']; allowed: ddp, pp2, disagg2, fsdp2" in result.stderr
