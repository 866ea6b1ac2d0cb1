"""Bad input on the SLURM path, one line each before anything is submitted or trained (issue 65): a SLURM
launcher without sbatch on PATH, and a requeued job that finds nothing of its first run. SLURM's own refusal of a
partition is tests/slurm/test_real_slurm.py's (it needs the real scheduler)."""

from __future__ import annotations

import pytest

from disttrain_core.config import typed_config
from disttrain_core.launch.cli import PreflightError, check_submitter


def test_a_slurm_launcher_without_sbatch_on_path_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    with pytest.raises(
        PreflightError, match=r"hydra/launcher=slurm submits each job with sbatch, which is not on PATH"
    ):
        check_submitter(["-m", "recipe=mllm_tiny_ddp2", "hydra/launcher=slurm"])
    check_submitter(["recipe=mllm_tiny_ddp2", "hydra/launcher=slurm"])  # without -m Hydra trains here: no sbatch


def test_a_requeued_job_without_its_first_run_is_refused_in_one_line(compose_cfg, tmp_path, monkeypatch):
    from disttrain_core.train.preflight import check_requeued_resume

    cfg = typed_config(compose_cfg("trainer.resume=auto"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    check_requeued_resume(cfg, run_dir)  # a first run: nothing to find
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(FileNotFoundError, match=r"requeued \(SLURM_RESTART_COUNT=1\) but its run directory .* no"):
        check_requeued_resume(cfg, run_dir)
    (run_dir / "metrics.jsonl").write_text("")  # the first run started but stopped before its first checkpoint
    check_requeued_resume(cfg, run_dir)
