"""tools/simulate.py: summary, JSON, Gantt PNG, errors."""

import json

from ..conftest import REPO, run_script


def simulate(*args, cwd):
    return run_script(REPO / "tools/simulate.py", list(args), timeout=120, cwd=cwd)


def test_json_output_and_png(tmp_path):
    out = simulate("schedule=1f1b", "pp=4", "microbatches=8", "format=json", f"out={tmp_path / 'g.png'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["bubble_fraction"] == 3 / 11
    assert summary["makespan"] == (8 + 3) * 3
    assert summary["peak_activations"] == [4, 3, 2, 1]
    assert (tmp_path / "g.png").stat().st_size > 10_000


def test_durations_and_interleaving(tmp_path):
    out = simulate(
        "schedule=interleaved_1f1b",
        "pp=4",
        "microbatches=8",
        "vpp=2",
        "t_f=1",
        "t_b=1",
        "t_p2p=0.1",
        "format=json",
        cwd=tmp_path,
    )
    summary = json.loads(out.stdout)
    assert summary["stages_per_rank"] == 2 and summary["makespan"] > (2 * 8 + 3)
    assert (tmp_path / "outputs/simulate/interleaved_1f1b_pp4_m8_v2.png").is_file()


def test_table_output_names_the_critical_path(tmp_path):
    out = simulate("schedule=zb_h1", "pp=2", "microbatches=4", cwd=tmp_path)
    assert "critical path:" in out.stdout and "0W3" in out.stdout


def test_bad_arguments_exit_2_with_one_line(tmp_path):
    for args in (["schedule=nope"], ["schedule=interleaved_1f1b", "pp=4", "microbatches=6", "vpp=2"], ["bogus=1"]):
        out = simulate(*args, cwd=tmp_path)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and out.stderr.startswith("error:"), out.stderr
