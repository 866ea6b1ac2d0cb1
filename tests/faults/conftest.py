"""Jobs for the fault suite: ``train.py`` in a process group of its own, bounded in time, and checked
for leftovers -- every process of the group (ranks, decode workers, producer, resource tracker) must be
gone when the job has ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import REPO, cli_overrides, read_metrics, warm_interpreter

STEPS = 10


def group_members(pgid: int) -> list[str]:
    """Live (not zombie) processes of process group ``pgid``: ``"pid command"`` each."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            state, pgrp = fields[0], int(fields[2])
            if pgrp == pgid and state != "Z":
                members.append(f"{entry.name} {(entry / 'cmdline').read_bytes()[:100]!r}")
        except (OSError, ValueError):
            continue
    return members


class Job:
    """``python train.py args`` started in a new session (a fork of the warm interpreter, tests/zygote.py,
    unless ``argv0`` starts it under another launcher); ``finish`` waits (bounded) and checks leftovers."""

    def __init__(self, args: list[str], log: Path, fault: str | None = None, argv0: list[str] | None = None):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("DISTTRAIN_FAULT", None)
        if fault:
            env["DISTTRAIN_FAULT"] = fault
        self.log = log
        self.started = time.monotonic()
        self.handle = open(log, "w")  # noqa: SIM115  closed in finish()
        if argv0 is None and os.environ.get("DISTTRAIN_TEST_COLD") != "1":  # a fork of the warm interpreter
            self.process = warm_interpreter().start(REPO / "train.py", args, REPO, env, log)
        else:
            command = argv0 or [sys.executable, str(REPO / "train.py")]
            output = {"stdout": self.handle, "stderr": subprocess.STDOUT}
            self.process = subprocess.Popen([*command, *args], cwd=REPO, env=env, start_new_session=True, **output)
        self.pgid = self.process.pid

    def finish(self, timeout: float = 60) -> tuple[int, str, float]:
        """(exit code, output, seconds); fails if the job overran or left a process behind."""
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.pgid, signal.SIGKILL)
            self.process.wait()
            pytest.fail(f"the job did not end within {timeout} s:\n{self.output()[-3000:]}")
        seconds = time.monotonic() - self.started
        deadline = time.monotonic() + 10  # helpers notice their parent's death within a second or two
        while group_members(self.pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = group_members(self.pgid)
        if left:
            os.killpg(self.pgid, signal.SIGKILL)
        self.handle.close()
        assert not left, f"processes outlived the job: {left}"
        return code, self.output(), seconds

    def output(self) -> str:
        if not self.handle.closed:
            self.handle.flush()
        return self.log.read_text()

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.pgid, signal.SIGKILL)
            self.process.wait()


def job_args(shards: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        *cli_overrides(shards, run_dir),
        "trainer.devices=2",
        f"trainer.max_steps={STEPS}",
        "trainer.dist_timeout_s=30",
        "trainer.stop_grace_s=20",
        *extra,
    ]


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a step trained twice (before a crash and after the resume) keeps its last value."""
    return {int(m["step"]): m["loss"] for m in read_metrics(run_dir) if "loss" in m}


def latest_step(run_dir: Path) -> int:
    name = (run_dir / "checkpoints" / "latest").read_text().strip()
    return int(name.split("_")[-1])


@pytest.fixture(scope="session")
def reference_losses(shards, tmp_path_factory) -> dict[int, float]:
    """An uninterrupted 2-process run of the same job."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    job = Job(job_args(shards, run_dir), run_dir.parent / "log.txt")
    code, output, _ = job.finish(timeout=180)
    assert code == 0, output[-3000:]
    result = losses(run_dir)
    assert sorted(result) == list(range(1, STEPS + 1))
    return result
