"""HotSPa end to end (train/hotspa.py): a bucketed step whose three buckets run under three strategies
(dp4 for the short rows, dp2tp2, tp2pp2 for the longest), parameters and gradients hot-switched inside the
step, gives the losses and parameters of one process training on the same packed documents, 5 steps,
fp32, within 1e-5."""

import pytest

from disttrain_core.train.checkpoint import latest_checkpoint, read_tensors

from ..conftest import read_metrics, run_train

pytestmark = pytest.mark.distributed

COMMON = [
    "model=llama_tiny",
    "model.llm.dim=64",
    "model.llm.ffn_dim=128",
    "model.llm.n_layers=4",
    "data=longtail_text",
    "data.packing.buckets=[32,64,128]",
    "data.packing.documents_per_step=24",
    "model.seq_len=128",
    "trainer.max_steps=5",
    "trainer.precision=32",
    "trainer.checkpoint.every_n_steps=5",
    "trainer.progress_bar=false",
    "optim.warmup_steps=2",
    "trainer.log_every_n_steps=1",
]


def _train(run_dir, *overrides):
    result = run_train(COMMON + [f"hydra.run.dir={run_dir}", *overrides], timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_three_strategies_in_one_step_match_one_process(tmp_path):
    one = _train(tmp_path / "one", "trainer.devices=1")
    hot = _train(tmp_path / "hot", "parallel=hotspa", "parallel.hotspa.strategies=[dp4,dp2tp2,tp2pp2]")
    losses, reference = [m["loss"] for m in read_metrics(hot)], [m["loss"] for m in read_metrics(one)]
    assert len(losses) == 5 and losses == pytest.approx(reference, abs=1e-5, rel=0)
    ours = read_tensors(latest_checkpoint(hot / "checkpoints"))
    theirs = read_tensors(latest_checkpoint(one / "checkpoints"))
    params = [k for k in theirs if k.startswith("llm.") and k in ours]
    assert len(params) >= 4 * 9  # every weight of every block, at least
    worst = max((ours[k] - theirs[k]).abs().max().item() for k in params)
    assert worst < 1e-5, worst
    assert losses[-1] < losses[0]  # and it learns
    assert all(0 < m["perf/switch_fraction"] < 1 for m in read_metrics(hot))  # switching is timed, and not all
