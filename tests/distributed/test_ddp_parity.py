"""Two data-parallel processes reproduce one process with the same global batch."""

import pytest
import torch

from disttrain_core.train.checkpoint import latest_checkpoint, read_tensors

from ..conftest import cli_overrides, read_metrics, run_train

pytestmark = pytest.mark.distributed

COMMON = [
    "trainer.max_steps=20",
    "trainer.precision=32",
    "optim.global_batch_size=8",
    "optim.micro_batch_size=2",
    "trainer.checkpoint.every_n_steps=0",
]


def test_two_processes_match_one_process(shards, tmp_path):
    runs = {}
    for devices in (1, 2):
        run_dir = tmp_path / f"dp{devices}"
        result = run_train(cli_overrides(shards, run_dir) + COMMON + [f"trainer.devices={devices}"])
        assert result.returncode == 0, result.stderr[-3000:]
        runs[devices] = run_dir
    one, two = (read_metrics(runs[d]) for d in (1, 2))
    assert [m["step"] for m in one] == list(range(1, 21)) == [m["step"] for m in two]
    for a, b in zip(one, two, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a["step"], a["loss"], b["loss"])
    assert one[-1]["loss"] < one[0]["loss"]  # it actually trained
    # And the weights after 20 steps agree too.
    params_one = read_tensors(latest_checkpoint(runs[1] / "checkpoints"))
    params_two = read_tensors(latest_checkpoint(runs[2] / "checkpoints"))
    worst = max((params_one[k] - params_two[k]).abs().max().item() for k in params_one)
    assert worst < 1e-4, worst
    assert torch.is_tensor(next(iter(params_one.values())))
