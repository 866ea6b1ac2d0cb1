"""Validation during training (train/evaluation.py): the held-out loss every trainer.val_every_n_steps and after
the last step, logged to metrics.jsonl and TensorBoard; the training run is bit-equal with and without it; every
engine's validation loss equals one process's (fp32)."""

import json
import math

import pytest
import torch

from ..conftest import REPO, read_metrics, run_script
from .test_units import SMALL, parameters, train

pytestmark = pytest.mark.distributed

VAL = ["trainer.val_every_n_steps=2", "trainer.val_batches=2"]  # 5 steps: evaluations after steps 2, 4 and 5


def validation(run_dir) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(run_dir) if "val/loss" in m}


@pytest.fixture(scope="module")
def reference(shards, val_shards, tmp_path_factory):
    # keep_best saves at every evaluation that improves val/loss: saving changes nothing in training
    best = ["trainer.checkpoint.keep_best=true", "trainer.checkpoint.keep_last=1"]
    return train(shards, tmp_path_factory.mktemp("validation") / "one", *SMALL, *VAL, *best)


def test_validation_is_logged_and_leaves_training_bit_equal(reference, shards, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plain = train(shards, tmp_path / "plain", *SMALL)
    assert [(m["step"], m["loss"]) for m in read_metrics(plain)] == [
        (m["step"], m["loss"]) for m in read_metrics(reference)
    ]  # bit-equal, not approximately
    ours, theirs = parameters(reference), parameters(plain)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    found = validation(reference)
    assert sorted(found) == [2, 4, 5]
    for record in found.values():
        assert record["val/ppl"] == pytest.approx(math.exp(record["val/lm_loss"]), rel=1e-9)
        assert record["val/loss"] == pytest.approx(record["val/lm_loss"] + record["val/gen_loss"], rel=1e-9)
    assert found[5]["val/lm_loss"] < found[2]["val/lm_loss"]  # it learns on samples it never trained on
    lowest = min(found, key=lambda s: found[s]["val/loss"])  # keep_best: its checkpoint is kept and named
    assert (reference / "checkpoints" / "best").read_text() == f"step_{lowest:08d}"
    assert (reference / "checkpoints" / f"step_{lowest:08d}" / "meta.json").is_file()
    events = {p.parent for p in (reference / "tensorboard").rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events.pop()))
    accumulator.Reload()
    curve = {event.step: event.value for event in accumulator.Scalars("val/loss")}
    assert sorted(curve) == [2, 4, 5]
    assert all(curve[s] == pytest.approx(found[s]["val/loss"], rel=1e-6) for s in curve)


ONE = ["parallel=dp", "schedule=none", "trainer.devices=1"]  # tools/evaluate.py's layout below


@pytest.mark.parametrize(
    "layout, evaluated_on",
    [
        (["parallel=dp", "trainer.devices=2"], ONE),
        (["parallel=pp2", "schedule=1f1b", "trainer.devices=2"], ONE),
        (["parallel=disagg2"], None),
        (["parallel=dp", "parallel.shard=zero3", "trainer.devices=2"], None),
    ],
    ids=["ddp", "pp2", "disagg2", "zero3"],
)
def test_a_layouts_validation_loss_equals_one_process(layout, evaluated_on, reference, shards, tmp_path):
    run = train(shards, tmp_path / "run", *layout, *SMALL, *VAL)
    ours, theirs = validation(run), validation(reference)
    assert sorted(ours) == sorted(theirs) == [2, 4, 5]
    for step, record in theirs.items():
        for key in ("val/loss", "val/lm_loss", "val/gen_loss"):
            assert abs(ours[step][key] - record[key]) < 1e-5, (step, key, ours[step][key], record[key])
    if evaluated_on is None:
        return
    # tools/evaluate.py: the 2-process run's last checkpoint (step 5) on one process, resharded by name
    done = run_script(REPO / "tools" / "evaluate.py", [f"path={run}", *evaluated_on], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    evaluated = json.loads(done.stdout.strip().splitlines()[-1])
    assert evaluated["step"] == 5
    for key in ("val/loss", "val/lm_loss", "val/gen_loss"):
        assert abs(evaluated[key] - ours[5][key]) < 1e-6, (key, evaluated[key], ours[5][key])


# Local SGD: 2 workers of 1 process, a synchronous first step, then a sync every 2 steps (after steps 3 and 5).
LOCAL_SGD = [
    "parallel=local_sgd",
    "trainer.devices=2",
    "parallel.local_sgd.warmup_steps=1",
    "parallel.local_sgd.sync_every=2",
]


@pytest.mark.parametrize("method", ["diloco", "edit"])  # edit: its layer-wise sync completes before evaluating
def test_local_sgd_evaluates_the_synced_model(method, shards, val_shards, tmp_path):
    """An evaluation after every step: the model of the last sync (after the warm-up step 1, after the syncs of
    steps 3 and 5), whatever the workers hold between syncs. So steps 2 and 4 repeat steps 1 and 3 exactly, and
    each checkpointed synced model evaluated on one process gives the logged numbers."""
    settings = [*LOCAL_SGD, f"parallel.local_sgd.method={method}", *SMALL]
    every = ["trainer.val_every_n_steps=1", "trainer.val_batches=2", "trainer.checkpoint.every_n_steps=1"]
    run = train(shards, tmp_path / "run", *settings, *every, "trainer.checkpoint.keep_last=5")
    plain = train(shards, tmp_path / "plain", *settings)
    assert [(m["step"], m["loss"]) for m in read_metrics(run)] == [(m["step"], m["loss"]) for m in read_metrics(plain)]
    ours, theirs = parameters(run), parameters(plain)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    found = validation(run)
    assert sorted(found) == [1, 2, 3, 4, 5]
    assert found[2]["val/loss"] == found[1]["val/loss"] and found[4]["val/loss"] == found[3]["val/loss"]
    assert found[3]["val/loss"] != found[1]["val/loss"]
    for step in (1, 3, 5):
        checkpoint = run / "checkpoints" / f"step_{step:08d}"
        done = run_script(REPO / "tools" / "evaluate.py", [f"path={checkpoint}", *ONE], timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        evaluated = json.loads(done.stdout.strip().splitlines()[-1])
        for key in ("val/loss", "val/lm_loss", "val/gen_loss"):
            assert abs(evaluated[key] - found[step][key]) < 1e-6, (step, key, evaluated[key], found[step][key])
