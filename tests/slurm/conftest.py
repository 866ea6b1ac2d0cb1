"""A real one-node SLURM for this folder's tests (tools/local_slurm.py): started once per test process that needs it,
stopped at its end. Skipped, with the reason, where it cannot start (not installed: ``make slurm``; not root)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from pathlib import Path

import pytest

from ..conftest import REPO

spec = importlib.util.spec_from_file_location("local_slurm", REPO / "tools" / "local_slurm.py")
local_slurm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(local_slurm)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The environment (SLURM_CONF) of a running local SLURM."""
    reason = local_slurm.missing()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    env = local_slurm.start(root)
    yield env
    local_slurm.stop(root)


def slurm_command(env: dict, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=timeout)


def job_state(env: dict, job: str) -> dict[str, str]:
    """``scontrol show job``'s fields of ``job`` (JobState, ExitCode, Restarts, ...)."""
    out = slurm_command(env, "scontrol", "show", "job", "-o", job).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def wait_for(env: dict, job: str, states: tuple[str, ...], timeout: float = 300) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = job_state(env, job)
        if fields.get("JobState") in states:
            return fields
        time.sleep(1)
    raise AssertionError(f"job {job} not in {states} after {timeout:.0f} s: {job_state(env, job)}")


def submit(env: dict, script: Path) -> str:
    result = slurm_command(env, "sbatch", "--parsable", str(script))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def job_logs(folder: Path) -> str:
    """Every log file under ``folder`` (the ranks' srun output), for an assertion's message."""
    return "\n".join(f"== {p}\n{p.read_text()[-1500:]}" for p in sorted(Path(folder).rglob("*_log.*")))


__all__ = ["job_logs", "job_state", "slurm", "slurm_command", "submit", "wait_for", "os"]
