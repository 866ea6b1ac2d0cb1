"""ZeRO-Offload for ZeRO-1 (``parallel.offload=optimizer`` with ``shard=zero1``): the optimizer's state and step
on the host, as DeepSpeed's ZeRO-Offload places them (seed 002's memory options; FSDP2's own offload, for zero2 and
zero3, is torch's ``CPUOffloadPolicy``: parallel/fsdp.py).

What moves: each bucket's fp32 master shard and AdamW's two moments (``12 / dp`` bytes per parameter) leave the
device; the parameters and the flat gradient buffer (8 bytes per parameter) stay, so the reduce-scatter and the
all-gather run on the device as before. A step:

1. the reduce-scatter leaves this replica's summed gradient shard in the device gradient buffer (as without
   offload); ``fetch_grads`` copies it into the host master's gradient (a pinned buffer on CUDA, the copies
   queued without blocking, then one wait for all of them: the host step needs the values);
2. the gradient norm and clipping read and scale the host gradients; AdamW (torch's fused CPU kernel) steps the
   host masters;
3. the all-gather's source slice is filled from the host master (``BucketedSync.gather_params`` copies the master
   into the device slice: a host-to-device copy, from pinned memory on CUDA) and gathered on the device.

The arithmetic is the same AdamW on the same fp32 values, so a run with offload equals one without it bit for bit
where both step on the same kind of processor (on this CPU the host is the device: tests/distributed/
test_offload.py checks the bookkeeping -- masters, gradients and checkpoints on the host -- not a transfer). The
cost: per step the shard's gradients down and its parameters up (4 bytes each per parameter / dp) over the
host-device link (``cluster.host_bandwidth_gbps``) and the step at the host's AdamW rate
(``cluster.host_adam_gparams``), neither overlapped with compute (planner/costs.py ``offload_s``).
``trainer.sync_debug`` is refused with it: step 1 waits for the device by design.
"""

from __future__ import annotations

import torch


def host_tensor(source: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of ``source`` (pinned when ``pin``: device copies from it can then run asynchronously)."""
    out = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pin)
    out.copy_(source.detach())
    return out


class HostMasters:
    """Moves the master shards of ZeRO-1's flat buffers (comm/buckets.py ``FlatBuckets``) to the host.

    Call after the buffers are bound (each master's gradient is then its slice of the device gradient buffer):
    the masters are replaced in place, in every flat's ``masters`` list, by host parameters whose gradients are
    host buffers; the device slices are kept to copy from (``fetch_grads``)."""

    def __init__(self, flats) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device gradient slice, host gradient)
        self.device = None
        for flat in flats:
            for index, master in enumerate(flat.masters):
                self.device = master.device
                pin = master.device.type == "cuda"
                host = torch.nn.Parameter(host_tensor(master, pin))
                host.grad = host_tensor(master.grad, pin) if master.grad is not None else None
                if master.grad is not None:
                    self.pairs.append((master.grad, host.grad))
                flat.masters[index] = host

    def fetch_grads(self) -> None:
        """Copy every reduced gradient shard to its host master's gradient, then wait for the copies."""
        with torch.no_grad():
            for device_grad, host_grad in self.pairs:
                host_grad.copy_(device_grad, non_blocking=True)
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the host step reads them next
