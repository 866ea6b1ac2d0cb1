"""Fault drill points (base/faults.py) a chaos drill aims at: a model's forward and backward of a given step, by
job rank and start when a replica group identified itself. One process, a tiny model; the kill and all-reduce
points are exercised by tests/faults/test_fault_tolerance.py."""

from __future__ import annotations

import pytest
import torch

from disttrain_core.base import faults


@pytest.fixture
def fresh_identity(monkeypatch):
    monkeypatch.setattr(faults, "_identity", None)


def _train(model, steps: int, seen: list[int]) -> None:
    step = {"now": 0}
    faults.install_model_hooks([model], rank=1, step_of=lambda: step["now"])
    for s in range(1, steps + 1):
        step["now"] = s
        model(torch.ones(2, 4)).sum().backward()
        seen.append(s)


@pytest.mark.parametrize("point", ["forward", "backward"])
def test_a_fault_fires_at_its_point_step_and_rank_only(point, monkeypatch, fresh_identity):
    monkeypatch.setenv(faults.ENV, f"raise@{point}:rank=1:step=3;raise@{point}:rank=0:step=2")
    model = torch.nn.Linear(4, 4)
    seen: list[int] = []
    with pytest.raises(faults.InjectedFault, match=f"at {point} 3 on rank 1"):
        _train(model, 5, seen)
    assert seen == [1, 2]  # rank 0's fault at step 2 is not this process's
    if point == "backward":  # the forward of step 3 ran; its backward was cut
        assert model.weight.grad is not None


def test_a_replica_groups_identity_makes_job_ranks_and_starts(monkeypatch, fresh_identity):
    # group 2 of groups of 2 processes, its first replacement: rank 1 in the group is job rank 5
    monkeypatch.setenv(faults.ENV, "raise@forward:rank=5:step=2:restart=1;raise@forward:rank=5:step=1")
    faults.identify(rank_offset=4, restart=1)
    seen: list[int] = []
    with pytest.raises(faults.InjectedFault, match="at forward 2 on rank 5"):
        _train(torch.nn.Linear(4, 4), 3, seen)
    assert seen == [1]  # step 1's fault is for the group's first start, not this replacement


def test_no_hooks_without_a_fault_planned_there(monkeypatch, fresh_identity):
    monkeypatch.setenv(faults.ENV, "kill@step:rank=1:step=2")
    model = torch.nn.Linear(4, 4)
    assert faults.install_model_hooks([model], rank=1, step_of=lambda: 1) == []
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_an_unknown_point_is_named():
    with pytest.raises(ValueError, match="POINT in .*'allreduce'"):
        faults.parse("kill@optimizer:rank=0:step=1")
