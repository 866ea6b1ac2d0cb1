"""Training on a pre-tokenized file (data.format=tokens): two data-parallel processes give the losses and
parameters of one process on the same windows (fp32, 1e-5), and a run resumed mid-way continues exactly."""

import numpy as np
import pytest

from disttrain_core.train.checkpoint import latest_checkpoint, read_tensors

from ..conftest import read_metrics, run_train

pytestmark = pytest.mark.distributed

COMMON = [
    "model=llama_tiny",
    "model.llm.dim=64",
    "model.llm.ffn_dim=128",
    "model.llm.n_layers=2",
    "model.seq_len=64",
    "data=tokens",
    "optim.global_batch_size=8",
    "optim.micro_batch_size=2",
    "trainer.max_steps=4",
    "trainer.precision=32",
    "trainer.accelerator=cpu",
    "trainer.checkpoint.every_n_steps=2",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=1",
]


def _train(tokens, run_dir, *overrides):
    result = run_train(COMMON + [f"data.path={tokens}", f"hydra.run.dir={run_dir}", *overrides], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_two_processes_and_a_resumed_run_equal_one_process(tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 384, 20_000).astype(np.uint16))
    one = _train(tokens, tmp_path / "one", "trainer.devices=1")
    two = _train(tokens, tmp_path / "two", "trainer.devices=2", "trainer.exit_after_step=2")
    assert len(read_metrics(two)) == 2
    _train(tokens, tmp_path / "two", "trainer.devices=2", "trainer.resume=auto")
    reference = [m["loss"] for m in read_metrics(one)]
    losses = [m["loss"] for m in read_metrics(two)]
    assert len(reference) == 4 and losses[-4:] == pytest.approx(reference, abs=1e-5, rel=0)
    ours = read_tensors(latest_checkpoint(two / "checkpoints"))
    theirs = read_tensors(latest_checkpoint(one / "checkpoints"))
    assert len(theirs) == 21 and ours.keys() == theirs.keys()  # the 2-layer model's parameters
    assert all(np.allclose(ours[k], theirs[k], atol=1e-5, rtol=0) for k in theirs)


def test_validation_on_a_held_out_token_file(tmp_path):
    """data.val.path: a token file of its own; evaluations after steps 2 and 4, the same windows each time;
    training bit-equal with and without them; two processes' held-out loss equals one process's (1e-5)."""
    tokens, held_out = tmp_path / "tokens.npy", tmp_path / "held_out.npy"
    # text the model can learn (a repeated pattern with noise), so the held-out loss must fall
    pattern = np.tile(np.arange(40, 104), 400)
    noise = np.random.default_rng(0).integers(0, 384, pattern.size)
    stream = np.where(np.random.default_rng(1).random(pattern.size) < 0.2, noise, pattern).astype(np.uint16)
    np.save(tokens, stream[:20_000])
    np.save(held_out, stream[20_000:])
    val = [f"data.val.path={held_out}", "trainer.val_every_n_steps=2", "trainer.val_batches=2"]
    one = _train(tokens, tmp_path / "one", "trainer.devices=1", *val)
    plain = _train(tokens, tmp_path / "plain", "trainer.devices=1")
    assert [m["loss"] for m in read_metrics(one)] == [m["loss"] for m in read_metrics(plain)]
    found = {m["step"]: m for m in read_metrics(one) if "val/loss" in m}
    assert sorted(found) == [2, 4] and found[4]["val/loss"] < found[2]["val/loss"]
    two = _train(tokens, tmp_path / "two", "trainer.devices=2", *val)
    theirs = {m["step"]: m for m in read_metrics(two) if "val/loss" in m}
    for step in (2, 4):
        assert abs(theirs[step]["val/loss"] - found[step]["val/loss"]) < 1e-5
