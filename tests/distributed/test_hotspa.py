"""HotSPa end to end (train/hotspa.py): a bucketed step whose three buckets run under three strategies
(dp4 for the short rows, dp2tp2, tp2pp2 for the longest; and with context parallelism: cp2dp2, dp4,
cp2tp2), parameters and gradients hot-switched inside the step, gives the losses and parameters of one
process training on the same packed documents, 5 steps, fp32: losses within 1e-5, parameters within 1e-4
with all but 1 in 1,000 elements within 1e-6 (see below)."""

import pytest
import torch

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


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("hotspa") / "one", "trainer.devices=1")


def parameters_agree(ours: dict, theirs: dict, bulk: bool = True) -> None:
    """Every parameter within 1e-4 of the reference, and (``bulk``) all but 1 in 1,000 elements within 1e-6.

    Sums in another order (ring attention; tensor-parallel partial sums; another CPU's kernels) change a
    gradient in its last bits, and an element whose gradient nearly cancels then gets an Adam step of another
    size (as in tests/distributed/test_context_parallel_training.py, 1e-4). On the AMD development machine the
    strategies without context parallelism agreed to 1e-5 everywhere; on an Intel Xeon without AVX512-BF16
    (2026-11-24) one element of 197 k (layers.2.attention.wo) ends 1.7e-5 off, 58 (0.03%) above 1e-6, the
    median 1.1e-8. The second bound keeps the check on the bulk: a wrong switch or reshard moves whole
    tensors, far more than 1 in 1,000 elements. With context parallelism every attention output differs in
    its last bits (ring attention's order of sums), so only the first bound holds there.
    """
    params = [k for k in theirs if k.startswith("llm.") and k in ours]
    assert len(params) >= 4 * 9  # every weight of every block, at least
    diffs = torch.cat([(ours[k] - theirs[k]).abs().flatten() for k in params])
    assert diffs.max().item() < 1e-4, diffs.max().item()
    outliers = int((diffs > 1e-6).sum())
    assert not bulk or outliers <= diffs.numel() // 1_000, (outliers, diffs.numel())


# The first set also recomputes differently per bucket (none / selective_op / full): the same numbers.
@pytest.mark.parametrize(
    "strategies, bulk, extra",
    [
        ("[dp4,dp2tp2,tp2pp2]", True, ["parallel.hotspa.recompute=[none,selective_op,full]"]),
        # 24 s; context-parallel parity stays in make test (test_context_parallel*.py)
        pytest.param("[cp2dp2,dp4,cp2tp2]", False, [], marks=pytest.mark.slow),
        # ... by all-to-all (parallel.cp_mode=ulysses; cp2tp2: one K/V head per rank, copied for the swap)
        pytest.param("[cp2dp2,dp4,cp2tp2]", False, ["parallel.cp_mode=ulysses"], marks=pytest.mark.slow),
        # trainer.compile (parallel/compile.py): a static graph per bucket and strategy, recompute inside the
        # compiled blocks, packed attention (varlen) run eagerly between their compiled pieces
        ("[dp4,dp2tp2,tp2pp2]", False, ["parallel.hotspa.recompute=[none,selective_op,full]", "trainer.compile=true"]),
    ],
    ids=["dp4_dp2tp2_tp2pp2", "cp2dp2_dp4_cp2tp2", "cp2dp2_dp4_cp2tp2_ulysses", "compiled"],
)
def test_three_strategies_in_one_step_match_one_process(one, strategies, bulk, extra, tmp_path):
    hot = _train(tmp_path / "hot", "parallel=hotspa", f"parallel.hotspa.strategies={strategies}", *extra)
    losses, reference = [m["loss"] for m in read_metrics(hot)], [m["loss"] for m in read_metrics(one)]
    assert len(losses) == 5 and losses == pytest.approx(reference, abs=1e-5, rel=0)
    ours = read_tensors(latest_checkpoint(hot / "checkpoints"))
    theirs = read_tensors(latest_checkpoint(one / "checkpoints"))
    parameters_agree(ours, theirs, bulk)
    assert losses[-1] < losses[0]  # and it learns
    assert all(0 < m["perf/switch_fraction"] < 1 for m in read_metrics(hot))  # switching is timed, and not all


@pytest.mark.slow  # 22 s; resuming across layouts stays in make test (test_reshard.py, test_resume.py)
def test_a_hotspa_run_resumes_under_another_home(one, tmp_path):
    """Stopped after step 3 with home tp2pp2 (the most sharded of dp4 / dp2tp2 / tp2pp2), resumed with
    strategies dp2tp2 / dp4 / dp2tp2 (home dp2tp2): the checkpoint (the home's state, saved by name) is
    resharded into the new home, the packed loader continues at step 4, and steps 4-5 and the final
    parameters are those of the uninterrupted one-process run."""
    run = tmp_path / "resumed"
    _train(run, "parallel=hotspa", "parallel.hotspa.strategies=[dp4,dp2tp2,tp2pp2]", "trainer.exit_after_step=3")
    _train(run, "parallel=hotspa", "parallel.hotspa.strategies=[dp2tp2,dp4,dp2tp2]", "trainer.resume=auto")
    metrics = read_metrics(run)
    resumed = {m["step"]: m["loss"] for m in metrics}
    reference = {m["step"]: m["loss"] for m in read_metrics(one)}
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    assert [resumed[s] for s in (4, 5)] == pytest.approx([reference[s] for s in (4, 5)], abs=1e-5, rel=0)
    ours = read_tensors(latest_checkpoint(run / "checkpoints"))
    theirs = read_tensors(latest_checkpoint(one / "checkpoints"))
    parameters_agree(ours, theirs)


def test_validation_in_every_strategy_equals_one_process(tmp_path):
    """Packed validation (data.packing's held-out documents: another seed's) after steps 2, 4 and 5: one
    process trains bit-equal with and without it; HotSPa evaluates each bucket in its own strategy (the home's
    parameters switched in, forward only) and gives one process's held-out losses within 1e-5."""
    # documents 0.05x the profile's lengths: every bucket gets rows (9, 3 and 11 in the first held-out step)
    val = ["trainer.val_every_n_steps=2", "trainer.val_batches=2", "data.packing.length_scale=0.05"]
    reference = _train(tmp_path / "one_val", "trainer.devices=1", *val)
    plain = _train(tmp_path / "one", "trainer.devices=1", "data.packing.length_scale=0.05")
    assert [m["loss"] for m in read_metrics(reference)] == [m["loss"] for m in read_metrics(plain)]
    expected = {m["step"]: m["val/loss"] for m in read_metrics(reference) if "val/loss" in m}
    assert sorted(expected) == [2, 4, 5]
    hot = _train(tmp_path / "hot", "parallel=hotspa", "parallel.hotspa.strategies=[dp4,dp2tp2,tp2pp2]", *val)
    found = {m["step"]: m["val/loss"] for m in read_metrics(hot) if "val/loss" in m}
    assert found == pytest.approx(expected, abs=1e-5, rel=0)
    losses = [m["loss"] for m in read_metrics(hot)]
    assert losses == pytest.approx([m["loss"] for m in read_metrics(plain)], abs=1e-5, rel=0)
