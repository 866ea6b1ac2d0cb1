"""The same 2-rank job started the three ways a cluster starts it -- by train.py (the reference), by
``torchrun --nproc-per-node 2`` and as ``srun --ntasks-per-node=2`` starts it (one process per rank,
SLURM's variables) -- trains in one run directory with one data producer and the reference's losses.
And a rank that hangs: the others time out, every rank dumps its flight recorder, and tools/flight.py
names the hung rank and the collective it never entered."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from disttrain_core.base.net import free_port

from ..conftest import REPO
from .conftest import Job, job_args, losses

pytestmark = pytest.mark.distributed
STEPS = 4


def _check(run_dir, outputs: str, reference: dict[int, float]) -> None:
    assert outputs.count("serving global batches on") == 1, "one producer per job"
    result = losses(run_dir)
    assert sorted(result) == list(range(1, STEPS + 1))
    for step, loss in result.items():
        assert loss == pytest.approx(reference[step], abs=1e-6), f"step {step}"
    assert (run_dir / "checkpoints" / "latest").is_file()


def test_torchrun_starts_one_job(shards, tmp_path, reference_losses):
    run_dir = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(REPO / "train.py")]
    args = job_args(shards, run_dir, f"trainer.max_steps={STEPS}", "data.producer.workers=1")
    code, out, _ = Job(args, tmp_path / "torchrun.log", argv0=torchrun).finish(timeout=90)
    assert code == 0, out[-3000:]
    _check(run_dir, out, reference_losses)


def test_srun_tasks_start_one_job(shards, tmp_path, reference_losses):
    # hydra.run.dir unset: both tasks must name the same directory from SLURM_JOB_ID alone
    job_id = f"{os.getpid()}{free_port()}"
    args = [a for a in job_args(shards, tmp_path, f"trainer.max_steps={STEPS}", "data.producer.workers=1")]
    args = [a for a in args if not a.startswith("hydra.run.dir")] + [f"paths.root_dir={tmp_path}"]
    port = str(free_port())
    processes = []
    for rank in range(2):
        env = {
            **os.environ,
            "SLURM_JOB_ID": job_id,
            "SLURM_STEP_ID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_NNODES": "1",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_TASKS_PER_NODE": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_NODELIST": "127.0.0.1",
            "SLURM_JOB_NAME": "train",
            "MASTER_PORT": port,
        }
        processes.append(
            subprocess.Popen(
                [sys.executable, str(REPO / "train.py"), *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = ""
    try:
        for process in processes:
            out, _ = process.communicate(timeout=120)
            outputs += out
            assert process.returncode == 0, out[-3000:]
    finally:
        for process in processes:
            process.kill()
    runs = list((tmp_path / "outputs" / "train" / "runs").iterdir())
    assert [r.name for r in runs] == [f"job-{job_id}.0"], "one run directory for the job"
    _check(runs[0], outputs, reference_losses)


def test_hung_rank_is_named_by_the_flight_tool(shards, tmp_path):
    run_dir = tmp_path / "run"
    timeout = 8
    args = job_args(shards, run_dir, f"trainer.dist_timeout_s={timeout}", "trainer.stop_grace_s=3")
    job = Job(args, tmp_path / "hang.log", fault="hang@step:rank=1:step=3")
    code, out, seconds = job.finish(timeout=timeout + 30 + 20)  # + start-up and two steps
    assert code != 0, out[-3000:]
    assert "rank 0 failed" in out or "rank 1 died" in out, out[-3000:]
    tool = subprocess.run(
        [sys.executable, str(REPO / "tools" / "flight.py"), str(run_dir)], capture_output=True, text=True, timeout=60
    )
    assert tool.returncode == 0, tool.stderr
    assert "rank 1 never entered all_reduce" in tool.stdout, tool.stdout
