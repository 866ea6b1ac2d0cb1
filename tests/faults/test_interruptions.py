"""One 10-step job interrupted every way a long job is (train.py, 2 gloo processes), resumed after each, and
finally equal, step by step, to the same job run without interruption (losses within 1e-6):

1. SIGTERM to one rank at step 3 (a preemption notice): every rank stops after step 4 (the flags are reduced
   while the next step runs), checkpoints, exit 0.
2. SIGTERM to train.py itself mid-run: forwarded to the ranks; checkpoint at the step reached, exit 0.
3. SIGKILL while a checkpoint is being written: that checkpoint never becomes ``latest``.
4. ENOSPC while a checkpoint is being written (decode workers running): one error line on every rank, the
   previous one stays latest.
5. SIGKILL of a rank mid-step (decode workers running): the job ends within seconds naming the rank and the
   signal (the other rank leaves on the broken collective, not when trainer.stop_grace_s runs out), and no
   process of the job (decode workers, resource tracker) is left.
6. ``trainer.max_restarts=1`` and a rank killed: torch's elastic agent relaunches both ranks from the latest
   checkpoint, they reconnect to the data producer (which outlives the restart) at their resumed position,
   and the job finishes.
Every job ends within 60 s and leaves no process of its process group behind (conftest.Job).
"""

from __future__ import annotations

import signal
import time

import pytest

from .conftest import STEPS, Job, job_args, latest_step, losses

pytestmark = pytest.mark.distributed


def _run(shards, run_dir, name, *extra, fault=None, timeout=60):
    job = Job(job_args(shards, run_dir, "trainer.resume=auto", *extra), run_dir.parent / f"{name}.log", fault)
    return job, job.finish(timeout=timeout)


def _wait_for_step(run_dir, step: int, job: Job, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job.process.poll() is not None:
            pytest.fail(f"the job ended before step {step}:\n{job.output()[-3000:]}")
        done = losses(run_dir) if (run_dir / "metrics.jsonl").is_file() else {}
        if done and max(done) >= step:
            return
        time.sleep(0.1)
    job.kill()
    pytest.fail(f"step {step} not reached in {timeout} s")


def test_interrupted_job_resumes_exactly(shards, tmp_path, reference_losses):
    run_dir = tmp_path / "run"

    # 1. SIGTERM to rank 1 as step 3 begins: the flags of step 3 are read after step 4
    _, (code, out, _) = _run(shards, run_dir, "term_rank", fault="term@step:rank=1:step=3")
    assert code == 0, out[-3000:]
    assert "stopping at step 4 (" in out and latest_step(run_dir) == 4

    # 2. SIGTERM to the launcher once step 5 is logged (it stops after step 6 or 7)
    job = Job(job_args(shards, run_dir, "trainer.resume=auto"), tmp_path / "term_launcher.log")
    _wait_for_step(run_dir, 5, job)
    job.process.send_signal(signal.SIGTERM)
    code, out, _ = job.finish(timeout=60)
    reached = max(losses(run_dir))
    assert code == 0, out[-3000:]
    assert latest_step(run_dir) == reached <= STEPS - 2, out[-3000:]

    # 3. SIGKILL of rank 1 while the next checkpoint is being written
    step = reached + 1
    _, (code, out, _) = _run(
        shards, run_dir, "kill_save", "trainer.checkpoint.every_n_steps=1", fault=f"kill@save:rank=1:step={step}"
    )
    assert code != 0 and "rank 1 died (SIGKILL)" in out, out[-3000:]
    assert latest_step(run_dir) == reached  # the interrupted save is not the latest

    # 4. the disk fills while rank 0 writes the checkpoint after that (decode workers running: a rank that
    #    raises ends them, they ignore the SIGTERM multiprocessing would end them with at exit)
    _, (code, out, _) = _run(
        shards,
        run_dir,
        "enospc",
        "trainer.checkpoint.every_n_steps=1",
        "data.num_workers=1",
        fault=f"enospc@save:rank=0:step={step + 1}",
    )
    assert code != 0 and "No space left on device" in out, out[-3000:]
    assert latest_step(run_dir) == step

    # 5. SIGKILL of rank 1 in the middle of training, decode workers running
    _, (code, out, seconds) = _run(
        shards, run_dir, "kill_rank", "data.num_workers=1", fault=f"kill@step:rank=1:step={step + 1}"
    )
    assert code == 1 and "error: rank 1 died (SIGKILL)" in out, out[-3000:]
    assert "no clean stop" not in out, out[-3000:]  # rank 0 left on the broken collective, not on its timer

    # 6. restarts: rank 0 killed once; the elastic agent relaunches from the latest checkpoint
    _, (code, out, _) = _run(
        shards,
        run_dir,
        "restart",
        "trainer.max_restarts=1",
        "trainer.checkpoint.every_n_steps=2",
        "data.producer.workers=1",  # the producer train.py starts outlives the restart
        fault=f"kill@step:rank=0:step={step + 1}",
        timeout=120,
    )
    assert code == 0 and "resumed from" in out, out[-3000:]

    result = losses(run_dir)
    assert sorted(result) == list(range(1, STEPS + 1))
    for number, loss in reference_losses.items():
        assert result[number] == pytest.approx(loss, abs=1e-6), f"step {number}"
