"""tools/bench_attention.py: packed-document attention, today's dense mask against FlexAttention (docs/GPU.md's
H100 figures). On a CPU the dense and causal variants run with tiny shapes; FlexAttention, which has no backward
there, is reported as unsupported rather than timed."""

import json

from ..conftest import REPO, run_script

TOOL = REPO / "tools" / "bench_attention.py"
TINY = ["device=cpu", "seq=64", "docs=4", "heads=4", "kv_heads=2", "head_dim=8", "dtype=float32", "warmup=1"]


def test_the_attention_bench_times_the_dense_mask_path_and_names_what_a_cpu_cannot_run(tmp_path):
    out = tmp_path / "attention.json"
    result = run_script(TOOL, [*TINY, "repeats=2", f"out={out}"], timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    variants = report["variants"]
    assert report["settings"]["seq"] == 64 and report["settings"]["docs"] == 4
    assert variants["dense_mask"]["median_s"] > 0 and variants["dense_mask"]["speed_over_dense_mask"] == 1.0
    assert variants["causal_unpacked"]["median_s"] > 0
    assert variants["varlen"]["median_s"] > 0 and variants["varlen"]["max_abs_difference_from_dense"] < 1e-5
    assert "backward" in variants["flex"]["unsupported"]


def test_a_sequence_the_documents_do_not_divide_is_one_line(tmp_path):
    result = run_script(TOOL, [*TINY, "seq=66", f"out={tmp_path / 'x.json'}"], timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: seq=66 is not a multiple of docs=4"
