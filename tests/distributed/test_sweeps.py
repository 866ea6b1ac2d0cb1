"""Hydra multirun: each job launches its own processes and writes its own run directory."""

import pytest
import yaml

from ..conftest import base_overrides, read_metrics, run_train

pytestmark = pytest.mark.distributed


def sweep_overrides(shards, sweep_dir):
    keep = [o for o in base_overrides(shards, sweep_dir) if not o.startswith("paths.output_dir")]
    return keep + [f"hydra.sweep.dir={sweep_dir}"]


def test_multirun_with_two_processes_per_job(shards, tmp_path):
    sweep = tmp_path / "sweep"
    result = run_train(
        [
            "-m",
            "optim.lr=1e-3,3e-4",
            "trainer.max_steps=5",
            "trainer.devices=2",
            "optim.global_batch_size=8",
            "optim.micro_batch_size=2",
        ]
        + sweep_overrides(shards, sweep)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lrs = []
    for job in ("0", "1"):
        metrics = read_metrics(sweep / job)
        assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
        lrs.append(yaml.safe_load((sweep / job / "config.yaml").read_text())["optim"]["lr"])
    assert lrs == [1e-3, 3e-4]


def test_optuna_sweeper_runs_trials_and_reports_the_best(shards, tmp_path):
    sweep = tmp_path / "optuna"
    result = run_train(
        ["hparams_search=optuna", "hydra.sweeper.n_trials=2", "trainer.max_steps=2"] + sweep_overrides(shards, sweep)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert set(best["best_params"]) == {"optim.lr", "optim.warmup_steps", "optim.weight_decay"}
    final = [read_metrics(sweep / job)[-1]["loss"] for job in ("0", "1")]
    assert best["best_value"] == pytest.approx(min(final))
