"""tools/bench_cp.py: the pure block count matches the causal work, and one tiny run (1 and 2 processes)
writes a JSON whose memory ratios, balance, cross-check and times are sane."""

import json

import pytest

from ..conftest import REPO

pytestmark = pytest.mark.distributed


@pytest.fixture
def bench_cp(monkeypatch):
    """The tool as a module; tools/ on sys.path so the spawned ranks can import its worker too."""
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import bench_cp

    return bench_cp


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_counted_work_covers_every_causal_entry_once(bench_cp, world, layout):
    entries = bench_cp.work_entries(layout, world, 256, heads=3)
    assert sum(entries) == 256 * 257 // 2 * 3
    if layout == "zigzag":
        assert len(set(entries)) == 1  # every rank the same work


def test_tiny_run_writes_sane_json(bench_cp, tmp_path):
    out = tmp_path / "bench_cp.json"
    options = ["lengths=64", "cps=1,2", "heads=4", "head_dim=16", "repeats=2", "picture=none", "format=json"]
    assert bench_cp.main([*options, f"out={out}"]) == 0
    result = json.loads(out.read_text())

    balance = {row["cp"]: row for row in result["balance"]["rows"]}
    assert sorted(balance) == [2, 4, 8]
    assert all(row["zigzag"]["max_over_mean"] <= 1.05 for row in balance.values())
    assert balance[4]["contiguous"]["max_over_mean"] == pytest.approx(1.75, abs=0.05)
    checks = result["balance"]["cross_check"]
    assert len(checks) == 2 and all(check["equal"] for check in checks), checks  # the real WorkCounter agrees

    memory = {row["cp"]: row for row in result["memory"]}
    assert memory[1]["ratio"] == 1.0
    assert 0.3 < memory[2]["ratio"] < 0.9, memory[2]
    assert len(memory[2]["bytes_per_rank"]) == 2

    rows = {(row["cp"], row["layout"]): row for row in result["attention"]}
    assert sorted(rows) == [(1, "sdpa"), (2, "contiguous"), (2, "zigzag")]
    for row in rows.values():
        assert len(row["per_rank"]) == row["cp"]
        assert all(0 < rank["cpu_s"] and rank["wait_s"] >= 0 for rank in row["per_rank"])
    assert rows[(2, "zigzag")]["per_rank"][0]["block_cpu_s"] > 0  # the block timer saw ring_attention's blocks

    timeline = result["timeline"]
    assert timeline["simulated"] and timeline["cp"] == 4 and "picture" not in timeline
    assert all(span > 0 for span in timeline["makespan_s"].values())


def test_every_mode_bench_writes_sane_json(monkeypatch, tmp_path):
    """tools/bench_cp_modes.py at 64 positions per rank, cp=2: every mode timed and its peak counted; the
    all-gather holds more than the ring (every rank's K/V and, in backward, their fp32 gradients at once)."""
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import bench_cp_modes

    out = tmp_path / "modes.json"
    options = ["positions=64", "cp=2", "modes=ring,allgather,ulysses", "repeats=1", "warmup=0", "format=json"]
    assert bench_cp_modes.main([*options, f"out={out}"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["modes"]) == {"ring", "allgather", "ulysses"} and row["cp"] == 2
    for values in row["modes"].values():
        assert values["busiest_rank_s"] > 0 and values["peak_bytes"] > 0
    assert row["modes"]["ring"]["time_vs_ring"] == row["modes"]["ring"]["peak_vs_ring"] == 1.0
    assert row["modes"]["allgather"]["peak_vs_ring"] > 1.0
    assert bench_cp_modes.tool_main(bench_cp_modes.main, ["cp=2", "modes=hybrid", "out=none"]) == 2  # one line
