"""SLURM through Hydra's submitit launcher, and tools/launch_script.py.

With sbatch, srun and sacct replaced by tests/unit/fake_slurm.py: ``python train.py -m recipe=<2-node recipe>
hydra/launcher=slurm`` submits, from this GPU-less machine, the sbatch script its header means (node count,
one task per GPU, the SIGTERM lead, requeue, submitit's job runner under srun), and tools/launch_script.py prints
the same ``#SBATCH`` lines; a CPU job submitted the same way really runs as srun starts it and trains. A GPU
cluster preset that contradicts a recipe (too few GPUs, too little memory) is one line naming both, before launch.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from disttrain_core.launch.cli import PreflightError, check_overrides, tool_main
from disttrain_core.validation.cluster_fit import scheduler_launcher

from ..conftest import REPO, read_metrics

FAKE = Path(__file__).with_name("fake_slurm.py")
TWO_NODES = "mllm9b_disagg_2node"


@pytest.fixture
def fake_slurm(tmp_path):
    """A PATH directory whose sbatch, srun and sacct are fake_slurm.py."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for command in ("sbatch", "srun", "sacct"):
        wrapper = bin_dir / command
        wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} {command} "$@"\n')
        wrapper.chmod(0o755)
    return bin_dir


def submit(args: list[str], bin_dir: Path, capture: Path, mode: str, timeout: float) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SLURM_CAPTURE": str(capture),
        "FAKE_SLURM_MODE": mode,
        "FAKE_SLURM_JOB_ID": str(40000 + os.getpid() % 10000),
        "PYTHONUNBUFFERED": "1",
    }
    command = [sys.executable, str(REPO / "train.py"), "-m", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=capture.parent)


def sbatch_lines(script: str) -> dict[str, str]:
    return {m[1]: m[2] or "" for m in re.finditer(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, re.MULTILINE)}


def run_tool(argv: list[str]) -> tuple[int, str, str]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_script", REPO / "tools" / "launch_script.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = tool_main(tool.main, argv)
    return status, out.getvalue(), err.getvalue()


def test_the_slurm_launcher_submits_a_two_node_recipe_as_its_header_means(fake_slurm, shards, tmp_path):
    capture = tmp_path / "submitted.sh"
    data = [f"data.path={shards}", "data.generate_if_missing=false"]
    args = [f"recipe={TWO_NODES}", "hydra/launcher=slurm", *data, f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    done = submit(args, fake_slurm, capture, mode="dump", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    script = capture.read_text()
    flags = sbatch_lines(script)
    # 2 nodes, one task per GPU: every task sees its node's 8 GPUs (8 per node / 8 tasks = 1 GPU per task)
    assert flags["nodes"] == "2" and flags["ntasks-per-node"] == "8" and flags["gpus-per-node"] == "8"
    assert "gpus-per-task" not in flags
    assert flags["signal"] == "TERM@900" and "requeue" in flags  # SIGTERM 900 s before the limit (> stop_grace_s)
    srun = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1 and srun[0].endswith(f"-u -m submitit.core._submit {tmp_path / 'sweep' / '.submitit' / '%j'}")

    # tools/launch_script.py: the same #SBATCH lines (its logs go to outputs/slurm/ instead of the sweep's folder)
    status, printed, err = run_tool([f"recipe={TWO_NODES}", *data])
    assert status == 0, err
    by_hand = sbatch_lines(printed)
    for flag in ("output", "error"):
        assert Path(by_hand.pop(flag)).name == Path(flags.pop(flag)).name
    assert by_hand == flags
    command = [line for line in printed.splitlines() if line.startswith("srun ")][0]
    assert shlex.split(command)[-4:] == [str(REPO / "train.py"), f"recipe={TWO_NODES}", *data]


def test_a_job_submitted_through_the_launcher_runs_under_srun_and_trains(fake_slurm, shards, tmp_path):
    """A CPU job the same way, run by the fake scheduler: srun starts one task per rank, submitit's runner loads the
    pickled Hydra job in each, base/launch_env.py finds srun's variables, and the two ranks train in one directory named
    by the job id (a requeued job keeps its id, so its rerun resumes there)."""
    capture = tmp_path / "submitted.sh"
    args = [
        "recipe=mllm_tiny_ddp2",
        "hydra/launcher=slurm",
        f"paths.root_dir={tmp_path}",
        f"data.path={shards}",
        "data.num_workers=0",
        "trainer.max_steps=2",
        "trainer.checkpoint.every_n_steps=0",
        "trainer.progress_bar=false",
        "trainer.log_every_n_steps=1",
        "optim.warmup_steps=1",
        "cluster.peak_flops_fp32=1e11",
    ]
    multiruns = tmp_path / "outputs" / "train" / "multiruns"
    try:
        done = submit(args, fake_slurm, capture, mode="run", timeout=240)
    finally:
        for pid_file in multiruns.glob("*/.submitit/*/fake_sbatch.pid"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)  # the fake job, if still running
    logs = "".join(p.read_text()[-2000:] for p in multiruns.glob("*/.submitit/*/*.out"))
    assert done.returncode == 0, done.stderr[-2000:] + logs
    flags = sbatch_lines(capture.read_text())
    assert (flags["nodes"], flags["ntasks-per-node"]) == ("1", "2")
    results = sorted(p.name for p in multiruns.glob("*/.submitit/*/*_result.pkl"))
    assert [name.split("_")[1] for name in results] == ["0", "1"]  # both tasks ran the job
    job_id = results[0].split("_")[0]
    run_dir = multiruns / f"job-{job_id}.0" / "0"  # every rank: the job's id (and srun's step), the sweep's job 0
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(np.isfinite(m["loss"]) for m in metrics)
    assert (run_dir / "checkpoints" / "latest").is_file()


def test_scheduler_submissions_are_told_apart_from_local_runs():
    assert scheduler_launcher(["-m", "recipe=x", "hydra/launcher=slurm"]) == "slurm"
    assert scheduler_launcher(["--multirun", "hydra/launcher=slurm_short"]) == "slurm_short"  # built on slurm
    assert scheduler_launcher(["-m", "hydra/launcher=submitit_slurm"]) == "submitit_slurm"
    assert scheduler_launcher(["recipe=x", "hydra/launcher=slurm"]) is None  # no -m: Hydra runs the job here
    assert scheduler_launcher(["-m", "hydra/launcher=basic"]) is None
    assert scheduler_launcher(["-m", "trainer.devices=2"]) is None


CONTRADICTIONS = [
    (["cluster=a800_80g"], r"needs 128 GPUs \(trainer.devices=8 x trainer.num_nodes=16\) .*cluster.num_gpus=32"),
    (["cluster.memory_per_device_gb=24"], r"need 29.3 GB per GPU .*cluster.memory_per_device_gb=24 "),
    (["cluster.gpus_per_node=4"], r"needs 8 GPUs per node .*cluster.gpus_per_node=4;"),
]


@pytest.mark.parametrize("overrides, message", CONTRADICTIONS, ids=["gpus", "memory", "node"])
def test_a_cluster_preset_that_contradicts_the_recipe_fails_before_launch_in_one_line(
    overrides, message, tmp_path, monkeypatch
):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(9000, dtype=np.uint32))
    argv = ["-m", "recipe=llama3_70b_3d", f"data.path={tokens}", "hydra/launcher=slurm", *overrides]
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])  # submitted from a login node without GPUs
    with pytest.raises(PreflightError) as error:  # train.py's preflight, before Hydra or any process starts
        check_overrides(argv)
    assert re.search(message, str(error.value)) and "\n" not in str(error.value), str(error.value)
    status, _, err = run_tool(["recipe=llama3_70b_3d", f"data.path={tokens}", *overrides])
    assert status == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_the_recipe_submits_from_a_login_node_without_gpus(tmp_path, monkeypatch):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(9000, dtype=np.uint32))
    argv = ["-m", "recipe=llama3_70b_3d", f"data.path={tokens}", "hydra/launcher=slurm"]
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    check_overrides(argv)  # this machine's devices are not the job's
    monkeypatch.setattr(sys, "argv", ["train.py", *argv[1:]])  # without -m the job would run here
    with pytest.raises(PreflightError, match="no CUDA device"):
        check_overrides(argv[1:])


def test_torchrun_commands_for_one_node_and_for_every_node(tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(140_000, dtype=np.uint32) % 1000)
    status, printed, err = run_tool(["recipe=llama3_8b_fsdp2", f"data.path={tokens}"])
    assert status == 0, err
    command = shlex.split(printed.splitlines()[-1])
    assert command[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node=8"] and "--nnodes" not in printed
    assert command[4:] == [str(REPO / "train.py"), "recipe=llama3_8b_fsdp2", f"data.path={tokens}"]
    status, printed, err = run_tool(["recipe=llama3_8b_128k_cp", f"data.path={tokens}", "format=torchrun"])
    assert status == 0, err
    assert "--nnodes=8" in printed and "--rdzv-id=llama3_8b_128k_cp-$JOB_ID" in printed and "every node" in printed
    elastic = ["recipe=llama3_8b_128k_cp", f"data.path={tokens}", "format=torchrun", "trainer.min_nodes=6"]
    status, printed, err = run_tool(elastic)
    assert status == 0, err
    assert "--nnodes=6:8 --max-restarts=2" in printed  # a restart for each node the job may lose
    status, _, err = run_tool(["recipe=llama3_8b_fsdp2", "data.path=/nonexistent/tokens.npy"])
    assert status == 2 and "/nonexistent/tokens.npy" in err  # the data is checked as on the cluster


def test_a_signal_lead_shorter_than_the_stop_grace_is_refused(shards):
    data = [f"data.path={shards}", "data.generate_if_missing=false"]
    status, _, err = run_tool([f"recipe={TWO_NODES}", *data, "trainer.stop_grace_s=1000"])
    assert status == 2 and "signals 900 s before the time limit but trainer.stop_grace_s=1000" in err, err
    status, printed, err = run_tool(
        [
            f"recipe={TWO_NODES}",
            *data,
            "trainer.stop_grace_s=1000",
            "launcher=slurm",
            "hydra.launcher.signal_delay_s=1200",
        ]
    )
    assert status == 0 and sbatch_lines(printed)["signal"] == "TERM@1200", err


def test_an_auto_recipe_gets_the_nodes_its_plan_uses_and_a_plan_of_part_nodes_is_refused():
    status, printed, err = run_tool(["recipe=mllm15b_auto_a100"])
    assert status == 0, err
    assert sbatch_lines(printed)["nodes"] == "32" and "Plan (parallel=auto" in printed and "256 of 256 GPUs" in printed
    status, _, err = run_tool(["recipe=mllm72b_auto_h100", "cluster.num_gpus=1272"])  # the plan uses part of a node
    assert status == 2 and "not a whole number of 8-GPU nodes" in err, err
