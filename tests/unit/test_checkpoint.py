"""Checkpoints are atomic: a crash mid-save never leaves a half-written latest."""

import threading

import pytest
import torch

from disttrain_core.train import checkpoint as ckpt
from disttrain_core.train.checkpoint import CheckpointManager, latest_checkpoint, load_file, resolve_resume


def manager(root, async_save=False, keep_last=2):
    return CheckpointManager(
        root, rank=0, world_size=1, barrier=lambda: None, keep_last=keep_last, async_save=async_save
    )


def test_save_then_load_with_weights_only(tmp_path):
    m = manager(tmp_path / "c")
    state = {"w": torch.arange(4.0), "nested": {"step": 3, "lr": [0.1, 0.2]}}
    m.save(3, {"model.pt": state, "data_dp00000.json": {"epoch": 1, "index": 9}}, {"dp_size": 1})
    path = latest_checkpoint(tmp_path / "c")
    assert path.name == "step_00000003"
    assert torch.equal(load_file(path, "model.pt")["w"], state["w"])
    assert load_file(path, "data_dp00000.json") == {"epoch": 1, "index": 9}


def test_async_save_snapshots_state_before_training_mutates_it(tmp_path):
    m = manager(tmp_path / "c", async_save=True)
    weights = torch.zeros(1000)
    m.save(1, {"model.pt": {"w": weights}}, {})
    weights.add_(1.0)  # training continues while the writer thread runs
    m.wait()
    assert torch.count_nonzero(load_file(latest_checkpoint(tmp_path / "c"), "model.pt")["w"]) == 0


def test_crash_mid_save_keeps_the_previous_checkpoint_latest(tmp_path, monkeypatch):
    m = manager(tmp_path / "c")
    m.save(1, {"model.pt": {"w": torch.ones(2)}}, {})
    real_write = ckpt._write_file

    def failing_write(path, obj):
        if path.name == "optimizer.pt":
            raise OSError("disk full")
        real_write(path, obj)

    monkeypatch.setattr(ckpt, "_write_file", failing_write)
    with pytest.raises(RuntimeError, match="disk full"):
        m.save(2, {"model.pt": {"w": torch.ones(2)}, "optimizer.pt": {}}, {})
    assert latest_checkpoint(tmp_path / "c").name == "step_00000001"
    assert list((tmp_path / "c").glob("step_00000002*"))[0].name.endswith(".partial")
    # The next run cleans the partial directory up.
    manager(tmp_path / "c")
    assert not list((tmp_path / "c").glob("*.partial"))


def test_keep_last_prunes_old_checkpoints(tmp_path):
    m = manager(tmp_path / "c", keep_last=2)
    for step in (1, 2, 3, 4):
        m.save(step, {"model.pt": {}}, {})
    assert sorted(p.name for p in (tmp_path / "c").glob("step_*")) == ["step_00000003", "step_00000004"]


def test_commit_waits_for_every_rank(tmp_path):
    """Rank 0 commits only after rank 1 has written its files (filesystem markers)."""
    root = tmp_path / "c"
    barrier = threading.Barrier(2)
    results = {}

    def rank(r):
        m = CheckpointManager(root, rank=r, world_size=2, barrier=barrier.wait, async_save=True)
        m.save(5, {f"data_dp{r:05d}.json": {"rank": r}}, {"dp_size": 2})
        m.wait()
        results[r] = True

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == {0: True, 1: True}
    path = latest_checkpoint(root)
    assert load_file(path, "data_dp00001.json") == {"rank": 1}


def test_resume_resolution(tmp_path):
    assert resolve_resume("none", tmp_path) is None
    assert resolve_resume("auto", tmp_path) is None  # nothing yet: start fresh
    manager(tmp_path / "checkpoints").save(7, {"model.pt": {}}, {})
    assert resolve_resume("auto", tmp_path).name == "step_00000007"
    assert resolve_resume(str(tmp_path), "/elsewhere").name == "step_00000007"
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_resume(str(tmp_path / "empty"), tmp_path)
