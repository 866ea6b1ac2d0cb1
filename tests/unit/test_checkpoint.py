"""Checkpoints (train/checkpoint.py, train/dcp_io.py): DCP state plus JSON files, committed atomically, with
checksums recorded while writing and verified while reading; damaged ones are refused in one line."""

import json

import pytest
import torch

from disttrain_core.parallel.flat_chunks import range_boxes, subtract
from disttrain_core.train import checkpoint as ckpt
from disttrain_core.train.checkpoint import (
    CheckpointManager,
    check_model,
    latest_checkpoint,
    read_json,
    read_meta,
    read_tensors,
    resume_candidates,
)
from disttrain_core.train.data_position import carry
from disttrain_core.train.dcp_io import CheckpointCorrupt, file_digest


def manager(root, async_save=False, keep_last=2):
    return CheckpointManager(
        root, rank=0, world_size=1, barrier=lambda: None, keep_last=keep_last, async_save=async_save
    )


def save(m, step, weights, files=None):
    m.save(step, {"model.w": weights}, files or {"trainer.json": {"step": step}}, {"model": {"fingerprint": "f"}})
    m.wait()


def load(m, path, size=4):
    target = {"model.w": torch.zeros(size)}
    m.load(path, target, read_meta(path))
    return target["model.w"]


def test_save_records_digests_computed_while_writing_and_loads_back(tmp_path):
    m = manager(tmp_path / "c")
    save(m, 3, torch.arange(4.0), {"trainer.json": {"step": 3}, "data_dp00000.json": {"epoch": 1, "index": 9}})
    path = latest_checkpoint(tmp_path / "c")
    assert path.name == "step_00000003" and (tmp_path / "c" / "latest").read_text() == path.name
    meta = read_meta(path)
    for name, record in meta["files"].items():  # DCP's files and the JSON ones, none read back to hash
        assert file_digest(path / name) == (record["sha256"], record["size"]), name
    assert ".metadata" in meta["files"] and any(n.endswith(".distcp") for n in meta["files"])
    assert read_json(path, "data_dp00000.json", meta) == {"epoch": 1, "index": 9}
    assert torch.equal(load(m, path), torch.arange(4.0))
    assert torch.equal(read_tensors(path)["w"], torch.arange(4.0))


def test_async_save_stages_a_copy_before_training_mutates_the_state(tmp_path):
    m = manager(tmp_path / "c", async_save=True)
    weights = torch.zeros(1000)
    m.save(1, {"model.w": weights}, {}, {})
    weights.add_(1.0)  # training continues while the writer thread runs
    m.wait()
    assert torch.count_nonzero(read_tensors(latest_checkpoint(tmp_path / "c"))["w"]) == 0


def test_crash_mid_save_keeps_the_previous_checkpoint_latest(tmp_path, monkeypatch):
    m = manager(tmp_path / "c")
    save(m, 1, torch.ones(2))
    real_write = ckpt._write_json

    def failing_write(path, obj):
        if path.name == "trainer.json":
            raise OSError("disk full")
        return real_write(path, obj)

    monkeypatch.setattr(ckpt, "_write_json", failing_write)
    with pytest.raises(RuntimeError, match="disk full"):
        save(m, 2, torch.ones(2))
    assert latest_checkpoint(tmp_path / "c").name == "step_00000001"
    assert list((tmp_path / "c").glob("step_00000002*"))[0].name.endswith(".partial")
    manager(tmp_path / "c")  # the next run cleans the partial directory up
    assert not list((tmp_path / "c").glob("*.partial"))


def test_keep_last_prunes_old_checkpoints(tmp_path):
    m = manager(tmp_path / "c", keep_last=2)
    for step in (1, 2, 3, 4):
        save(m, step, torch.ones(1))
    assert sorted(p.name for p in (tmp_path / "c").glob("step_*")) == ["step_00000003", "step_00000004"]


def test_the_best_checkpoint_outlives_pruning(tmp_path):
    """trainer.checkpoint.keep_best: a checkpoint saved with meta["best"] is named by <root>/best and kept while
    newer ones rotate; a newer best replaces it (and the old one is pruned as usual)."""
    m = manager(tmp_path / "c", keep_last=1)
    best = {"model": {"fingerprint": "f"}, "best": {"val_loss": 2.0}}
    m.save(1, {"model.w": torch.ones(1)}, {"trainer.json": {"step": 1}}, best)
    m.wait()
    for step in (2, 3):
        save(m, step, torch.ones(1))
    assert sorted(p.name for p in (tmp_path / "c").glob("step_*")) == ["step_00000001", "step_00000003"]
    assert (tmp_path / "c" / "best").read_text() == "step_00000001"
    m.save(4, {"model.w": torch.ones(1)}, {"trainer.json": {"step": 4}}, {**best, "best": {"val_loss": 1.0}})
    m.wait()
    assert sorted(p.name for p in (tmp_path / "c").glob("step_*")) == ["step_00000004"]
    assert (tmp_path / "c" / "best").read_text() == "step_00000004"


def _damage(path, how):
    data = next(f for f in path.iterdir() if f.name.endswith(".distcp"))
    if how == "truncated":
        data.write_bytes(data.read_bytes()[:-7])
    elif how == "flipped":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
    elif how == "meta_missing":
        (path / "meta.json").unlink()


@pytest.mark.parametrize(
    "how, reason",
    [
        ("truncated", "truncated"),
        ("flipped", "differs from meta.json's SHA-256"),
        ("meta_missing", "meta.json is missing"),
    ],
)
def test_a_damaged_checkpoint_is_refused_with_its_reason(how, reason, tmp_path):
    m = manager(tmp_path / "c")
    save(m, 1, torch.arange(4.0))
    path = latest_checkpoint(tmp_path / "c")
    _damage(path, how)
    with pytest.raises(CheckpointCorrupt, match=reason) as error:
        load(m, path) if how != "meta_missing" else read_meta(path)
    assert "\n" not in str(error.value)


def test_resume_candidates_newest_first_and_the_other_model_refused(tmp_path):
    assert resume_candidates("none", tmp_path) == []
    assert resume_candidates("auto", tmp_path) == []  # nothing yet: start fresh
    m = manager(tmp_path / "checkpoints", keep_last=3)
    for step in (3, 7):
        save(m, step, torch.ones(1))
    assert [p.name for p in resume_candidates("auto", tmp_path)] == ["step_00000007", "step_00000003"]
    assert resume_candidates(str(tmp_path), "/elsewhere")[0].name == "step_00000007"
    with pytest.raises(FileNotFoundError, match="no checkpoint there"):
        resume_candidates(str(tmp_path / "empty"), tmp_path)
    path = latest_checkpoint(tmp_path / "checkpoints")
    meta = json.loads((path / "meta.json").read_text())
    check_model(path, meta, "llama_tiny", "f")
    with pytest.raises(ValueError, match="holds model None .*this run builds model 'mllm_tiny'"):
        check_model(path, meta, "mllm_tiny", "g")


def test_range_boxes_cover_a_flat_range_exactly_in_few_contiguous_boxes():
    import math
    import random

    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = math.prod(shape)
        start = rng.randint(0, n)
        stop = rng.randint(start, n)
        flat = torch.arange(n).view(shape)
        boxes, seen = range_boxes(shape, start, stop), []
        assert len(boxes) <= 2 * len(shape) - 1
        for offsets, sizes, first in boxes:
            values = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1).tolist()
            assert values == list(range(first, first + len(values)))  # contiguous in memory
            seen += values
        assert seen == list(range(start, stop))
        rest = [((0,) * len(shape), shape)]
        for offsets, sizes, _ in boxes:
            rest = [piece for box in rest for piece in subtract(box, (offsets, sizes))]
        assert sum(math.prod(s) for _, s in rest) == n - (stop - start)


def test_data_positions_carry_exactly_or_say_what_repeats():
    two = [{"epoch": 0, "index": 6, "skipped": {"bad": 1}}, {"epoch": 0, "index": 6, "skipped": {"bad": 2}}]
    same = carry(two, 2, None)
    assert same.exact and same.message is None and same.states[1]["index"] == 6
    one = carry(two, 1, [24] * 4)  # 2 streams at element 6 = the first 12 of the canonical order
    assert one.exact and one.states == [{"epoch": 0, "index": 12, "skipped": {"bad": 3}, "truncated_images": 0}]
    four = carry(one.states, 4, [24] * 4)
    assert four.exact and [s["index"] for s in four.states] == [3, 3, 3, 3]
    odd = carry([{"epoch": 0, "index": 5}], 2, [24] * 4)  # 5 elements do not split over 2 streams
    assert not odd.exact and [s["index"] for s in odd.states] == [2, 2] and "1 elements are read again" in odd.message
    uneven = carry(two, 1, [24, 24, 24, 20])
    assert not uneven.exact and uneven.states[0]["index"] == 0 and "unequal" in uneven.message


def test_a_well_formed_but_damaged_meta_json_is_refused(tmp_path):
    m = manager(tmp_path / "c")
    save(m, 1, torch.ones(2))
    path = latest_checkpoint(tmp_path / "c")
    meta = json.loads((path / "meta.json").read_text())
    meta["files"][".metadata"] = "oops"
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointCorrupt, match="meta.json is damaged"):
        read_meta(path)


def test_resuming_an_older_checkpoint_supersedes_the_newer_ones(tmp_path):
    """After a fallback (or a rollback) the newer checkpoints belong to another history: kept aside, never
    pruned in place of the new ones, never resumed by resume=auto."""
    root = tmp_path / "checkpoints"
    m = manager(root, keep_last=3)
    for step in (1, 2, 3):
        save(m, step, torch.ones(1))
    assert sorted(m.supersede_after(1)) == ["step_00000002", "step_00000003"]
    names = sorted(p.name for p in root.iterdir())
    assert "step_00000002.superseded" in names and "step_00000003.superseded" in names
    assert [p.name for p in resume_candidates("auto", tmp_path)] == ["step_00000001"]
    save(m, 2, torch.full((1,), 2.0))  # the resumed run's own step 2: the newest, kept by pruning
    assert [p.name for p in resume_candidates("auto", tmp_path)] == ["step_00000002", "step_00000001"]
    assert torch.equal(read_tensors(latest_checkpoint(root))["w"], torch.full((1,), 2.0))
    assert m.supersede_after(1) == ["step_00000002"]  # a second rollback: the first one's copies stay
    assert (root / "step_00000002.superseded2").is_dir() and (root / "step_00000002.superseded").is_dir()
