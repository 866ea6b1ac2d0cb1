"""Checkpoints a run can trust, end to end through ``python train.py``:

* a truncated file, a flipped byte and a missing meta.json are each skipped with a one-line warning naming
  the reason, and the run resumes from the newest checkpoint that verifies;
* a checkpoint of another model stops the run before launch, in one line naming both models;
* frozen parameters are saved: train, freeze the encoder, resume -- the encoder continues bit-equal to the
  trained one, and every later checkpoint holds it.
"""

import shutil

import pytest
import torch

from disttrain_core.train.checkpoint import read_tensors

from ..conftest import cli_overrides, read_metrics, run_train

pytestmark = pytest.mark.distributed

COMMON = [
    "trainer.precision=32",
    "trainer.checkpoint.every_n_steps=1",
    "trainer.checkpoint.keep_last=4",
    "optim.global_batch_size=4",
    "optim.micro_batch_size=2",
]


def _train(shards, run_dir, *overrides):
    result = run_train(cli_overrides(shards, run_dir) + COMMON + list(overrides), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def _distcp(path):
    return next(f for f in sorted(path.iterdir()) if f.name.endswith(".distcp"))


def test_damaged_checkpoints_fall_back_to_the_newest_that_verifies(shards, tmp_path):
    run = tmp_path / "run"
    _train(shards, run, "model=llama_tiny", "trainer.max_steps=4")
    root = run / "checkpoints"
    kept = shutil.copytree(root, tmp_path / "kept")  # undamaged copies for the reference below
    truncated = _distcp(root / "step_00000002")
    truncated.write_bytes(truncated.read_bytes()[:-100])
    flipped = _distcp(root / "step_00000003")
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    flipped.write_bytes(bytes(raw))
    (root / "step_00000004" / "meta.json").unlink()
    output = _train(shards, run, "model=llama_tiny", "trainer.max_steps=5", "trainer.resume=auto")
    skipped = [line for line in output.splitlines() if "skipped:" in line]
    assert len(skipped) == 3, output[-3000:]
    assert "step_00000004 skipped: meta.json is missing" in skipped[0]
    assert "step_00000003 skipped:" in skipped[1] and "differs from meta.json's SHA-256" in skipped[1]
    assert "step_00000002 skipped:" in skipped[2] and "truncated" in skipped[2]
    assert "resumed from" in output and "step_00000001 at step 1" in output
    assert "renamed *.superseded" in output  # the damaged newer ones are kept aside, not resumed later
    # Steps 2-5 after the fallback equal those of the first run (which read the same data from step 1 on).
    first = {m["step"]: m["loss"] for m in read_metrics(run) if m["step"] <= 4}
    losses = [m for m in read_metrics(run)]
    resumed = {m["step"]: m["loss"] for m in losses[4:]}
    assert sorted(resumed) == [2, 3, 4, 5]
    for step in (2, 3, 4):
        assert resumed[step] == pytest.approx(first[step], abs=1e-6)
    assert (kept / "step_00000001").is_dir()


def test_a_checkpoint_of_another_model_stops_before_launch(shards, tmp_path):
    run = tmp_path / "llama"
    _train(shards, run, "model=llama_tiny", "trainer.max_steps=1")
    result = run_train(cli_overrides(shards, tmp_path / "mllm") + COMMON + [f"trainer.resume={run}"], timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: checkpoint") and "'llama_tiny'" in lines[-1] and "'mllm_tiny'" in lines[-1]
    assert "Traceback" not in result.stderr


def test_frozen_parameters_are_saved_and_continue_bit_equal(shards, tmp_path):
    run = tmp_path / "run"
    _train(shards, run, "trainer.max_steps=2")
    trained = read_tensors(run / "checkpoints" / "step_00000002")
    _train(shards, run, "trainer.max_steps=4", "trainer.resume=auto", "model.freeze.encoder=true")
    encoder = sorted(k for k in trained if k.startswith("encoder."))
    assert encoder
    for step in (3, 4):
        later = read_tensors(run / "checkpoints" / f"step_{step:08d}")
        assert set(later) == set(trained)  # every parameter, the frozen ones included
        for name in encoder:
            assert torch.equal(later[name], trained[name]), (step, name)
        assert not torch.equal(later["llm.norm.weight"], trained["llm.norm.weight"])  # the rest trained on
