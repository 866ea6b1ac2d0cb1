"""trainer.sync_debug on a CPU: the operations that would stall a GPU step are caught; fixed-shape device
work is not."""

import logging

import pytest
import torch

from disttrain_core.train.host_sync import HostSyncError, HostSyncGuard

X = torch.arange(-3.0, 5.0)

SYNCING = {
    "item": lambda: X.sum().item(),
    "float": lambda: float(X.sum()),
    "if tensor": lambda: bool(X.sum() > 0),
    "boolean mask": lambda: X[X > 0],
    "nonzero": lambda: torch.nonzero(X),
    "tolist": lambda: X.tolist(),
    "cpu": lambda: X.cpu(),
    "repeat_interleave": lambda: torch.repeat_interleave(X, torch.ones(8, dtype=torch.long)),
}


@pytest.mark.parametrize("name", list(SYNCING))
def test_error_mode_raises_on_each_host_synchronization(name):
    guard = HostSyncGuard("error", torch.device("cpu"))
    with pytest.raises(HostSyncError, match="host synchronization on the hot path"):
        with guard.check(True):
            SYNCING[name]()


def test_fixed_shape_device_work_passes_and_unchecked_steps_are_free():
    guard = HostSyncGuard("error", torch.device("cpu"))
    with guard.check(True):
        norm = X.square().sum().sqrt()
        torch.nn.utils.clip_grads_with_norm_([torch.nn.Parameter(X.clone())], 1.0, norm)
        torch.argsort((X > 0).to(torch.int8), stable=True)
        torch.repeat_interleave(X, torch.ones(8, dtype=torch.long), output_size=8)
        X.clamp(min=0.0).gather(0, torch.tensor([1, 2]))
    with guard.check(False):
        X.tolist()
    assert guard.summary() == {"debug/sync_checked_steps": 1.0, "debug/host_syncs": 0.0}
    assert torch.Tensor.tolist is not None and "wrapper" not in torch.Tensor.tolist.__qualname__  # restored


def test_warn_mode_counts_and_logs_each_call_site_once(caplog):
    guard = HostSyncGuard("warn", torch.device("cpu"))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with guard.check(True):
                X.sum().item()
    assert guard.summary()["debug/host_syncs"] == 3.0
    assert sum("host synchronization" in r.message for r in caplog.records) == 1
