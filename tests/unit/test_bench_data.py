"""tools/bench_data.py: a producer serving trainer ranks on loopback, each rank's share against the whole batch,
and the bytes predicted for the paper's 1,172-GPU plan (docs/PERFORMANCE.md)."""

import json

from ..conftest import REPO, run_script

TOOL = REPO / "tools" / "bench_data.py"


def test_shares_cost_their_samples_and_the_same_batches_reach_the_ranks_from_a_pool_too(tmp_path):
    out = tmp_path / "data.json"
    pool = ["producers=1,2", "pool_dp=4", "pool_micro=2", "pool_steps=3", "decode_ms=25"]
    result = run_script(TOOL, ["ranks=6", "dp=2", "micro=2", "slots=1", "steps=2", *pool, f"out={out}"], timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    shares, whole = report["measured"]
    assert shares["per_rank"] and not whole["per_rank"] and shares["ranks"] == 6 and shares["pp"] == 3
    assert shares["first_stage_bytes_over_own"] <= 1.05  # the first stages: their samples' bytes plus framing
    assert whole["first_stage_bytes_over_own"] > 1.5  # whole batches: the other replica's samples too
    assert shares["bytes_per_step_all_ranks"] < 0.5 * whole["bytes_per_step_all_ranks"]
    assert shares["samples_per_s"] > 0 and shares["producer_peak_rss_mb"] > 0
    one, two = report["pool"]  # the same batches (checked by the tool), decoded by two producers in half the time
    assert (one["producers"], two["producers"]) == (1, 2)
    assert two["speedup"] > 1.5, report["pool"]
    p = report["predicted"]
    assert p["gpus"] <= 1172 and p["global_batch"] > 0
    assert sum(r["ranks"] for r in p["per_rank_roles"]) == p["gpus"]
    assert p["per_rank_max_bytes_per_rank"] < p["whole_batch_bytes_per_rank"] / 10
    assert p["whole_batch_bytes_per_step"] == p["gpus"] * p["whole_batch_bytes_per_rank"]


def test_ranks_the_replicas_do_not_divide_are_one_line(tmp_path):
    result = run_script(TOOL, ["ranks=6", "dp=4", f"out={tmp_path / 'x.json'}"], timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: ranks=6 dp=4: give as many of each, each dp dividing ranks")
