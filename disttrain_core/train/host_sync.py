"""``trainer.sync_debug``: find host synchronizations on the training hot path.

A GPU step should queue its work and return: every read of a device value on
the host (``.item()``, ``float(t)``, ``if t:``, ``.tolist()``, ``.cpu()``), every
operation whose output shape depends on the data (boolean-mask indexing,
``nonzero``, ``masked_select``, ``unique``) and every ``torch.cuda.synchronize``
stalls the host until the device catches up, and with it the communication
overlap. The loop keeps loss sums, token counts and the gradient norm on the
device and reads them at logging steps only; this switch checks that.

* CUDA: torch's own ``torch.cuda.set_sync_debug_mode`` is on while a checked
  step runs (``warn`` or ``error``).
* CPU, where nothing synchronizes but the same code will on a GPU: a dispatch
  mode flags the operations above (and the Python-level ``.tolist()``,
  ``.cpu()``, ``.numpy()`` and ``torch.cuda.synchronize``) while a checked step
  runs. ``warn`` logs each distinct call site once; ``error`` raises at the first.
* Both: an operator given a host tensor (more than a 0-d scalar) beside device
  tensors -- an index kept on the host, copied to the device at every call --
  is flagged too (on CPU it shows wherever parameters sit on another device,
  as in tests/unit/test_gpu_paths.py with the meta device).

Checked: the engine's part of every step that is not a logging or checkpoint
step (timelines are recorded at logging steps), from the second step on (the
first records DDP-style bucket orders and builds lazily initialized state), and
no step while the communication trace is on. Fetching and slicing the host-side
batch happens before the checked region: it reads CPU tensors on a GPU too.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..base.torch_compat import TorchDispatchMode

log = logging.getLogger(__name__)

MODES = ("off", "warn", "error")

aten = torch.ops.aten
# Operators that read a device value on the host or size their output from the data.
SYNCING_OPS = {
    aten._local_scalar_dense,  # .item(), float(t), int(t), bool(t)
    aten.is_nonzero,
    aten.equal,
    aten.nonzero,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.repeat_interleave,  # without output_size it sizes its output from the data
}
# Python-level reads that never reach the dispatcher on a CPU tensor.
SYNCING_METHODS = (
    (torch.Tensor, "tolist"),
    (torch.Tensor, "cpu"),
    (torch.Tensor, "numpy"),
    (torch.cuda, "synchronize"),
)


class HostSyncError(RuntimeError):
    pass


def _call_site() -> str:
    """The innermost frame outside torch and this module."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename
        if "/torch/" not in name and not name.endswith("host_sync.py") and "contextlib" not in name:
            return f"{name}:{frame.lineno} ({frame.line})"
    return "unknown"


# Indexing with a boolean mask sizes its output from the mask (a nonzero inside the operator).
MASKABLE_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _host_operand(args, kwargs) -> str | None:
    """The device of the non-host operands when an operator also takes a host tensor (not a 0-d scalar): on
    CUDA an index or mask kept on the host is copied to the device at every call, from pageable memory (a
    host synchronization). None when the operands share a device."""
    from torch.utils._pytree import tree_leaves

    devices = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if "cpu" in devices and len(devices) > 1:
        return sorted(devices - {"cpu"})[0]
    return None


def _boolean_mask(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class _Detector(TorchDispatchMode):
    def __init__(self, report, host_operands_only: bool = False):
        super().__init__()
        self.report = report
        self.host_operands_only = host_operands_only  # CUDA: torch's sync debug mode sees the rest

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = getattr(func, "overloadpacket", None)
        if self.host_operands_only:
            if (device := _host_operand(args, kwargs or {})) is not None:
                self.report(f"{packet} takes a host tensor with {device} tensors (copied at every call)")
        elif packet in SYNCING_OPS and not (packet is aten.repeat_interleave and (kwargs or {}).get("output_size")):
            self.report(str(packet))
        elif packet in MASKABLE_OPS and _boolean_mask(args):
            self.report(f"{packet} with a boolean mask")
        elif (device := _host_operand(args, kwargs or {})) is not None:
            self.report(f"{packet} takes a host tensor with {device} tensors (copied at every call)")
        return func(*args, **(kwargs or {}))


class HostSyncGuard:
    """Wraps the checked part of a step; counts (warn) or raises on (error) host synchronizations."""

    def __init__(self, mode: str, device: torch.device):
        if mode not in MODES:
            raise ValueError(f"trainer.sync_debug={mode!r}: allowed values are {', '.join(MODES)}")
        self.mode, self.device = mode, device
        self.checked_steps = 0
        self.found: dict[str, int] = {}  # call site -> count

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def _report(self, what: str) -> None:
        site = _call_site()
        if self.mode == "error":
            raise HostSyncError(f"host synchronization on the hot path: {what} at {site}")
        if site not in self.found:
            log.warning("host synchronization on the hot path: %s at %s", what, site)
        self.found[site] = self.found.get(site, 0) + 1

    @contextmanager
    def check(self, active: bool) -> Iterator[None]:
        if not (self.enabled and active):
            yield
            return
        self.checked_steps += 1
        if self.device.type == "cuda":  # torch's own checker, and ours for host operands
            torch.cuda.set_sync_debug_mode(self.mode)
            try:
                with _Detector(self._report, host_operands_only=True):
                    yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
            return
        originals = [(owner, name, getattr(owner, name)) for owner, name in SYNCING_METHODS]

        thread = threading.get_ident()  # other threads (data, communication) are not the hot path

        def flagged(owner, name, original):
            def wrapper(*args, **kwargs):
                if threading.get_ident() == thread:
                    self._report(f"{getattr(owner, '__name__', owner)}.{name}")
                return original(*args, **kwargs)

            return wrapper

        for owner, name, original in originals:
            setattr(owner, name, flagged(owner, name, original))
        try:
            with _Detector(self._report):
                yield
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)

    def summary(self) -> dict[str, float]:
        return {
            "debug/sync_checked_steps": float(self.checked_steps),
            "debug/host_syncs": float(sum(self.found.values())),
        }
