"""parallel.local_sgd.offload: the outer step with anchors and outer momentum in host memory gives the same
parameters as with them beside the parameters. On this CPU machine both live in the same memory, so this
checks the offload path's arithmetic (anchor to the device, pseudo-gradient to the host, outer step there),
not a transfer; the validation refuses offload outside CUDA."""

import copy

import torch

from disttrain_core.train.local_sgd.sync import OuterSync


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 8)


def _outer(model, offload: bool) -> OuterSync:
    named = list(model.named_parameters())
    owner = {n: 0 for n, _ in named}
    outer = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    return OuterSync(model, named, owner, 0, 0, None, None, 1, 1, outer, False, offload=offload)


def test_offloaded_outer_steps_equal_the_device_ones():
    torch.manual_seed(0)
    a = Tiny()
    b = copy.deepcopy(a)
    start = copy.deepcopy(a)
    sync_a, sync_b = _outer(a, offload=False), _outer(b, offload=True)
    assert all(anchor.device.type == "cpu" for anchor in sync_b.anchors.values())
    for round_ in range(3):  # local drift, then a sync: momentum carries across rounds
        with torch.no_grad():
            for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
                drift = torch.randn_like(pa) * 0.1 * (round_ + 1)
                pa.add_(drift)
                pb.add_(drift)
        sync_a.sync_now()
        sync_b.sync_now()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert all(not torch.equal(p, q) for p, q in zip(a.parameters(), start.parameters(), strict=True))
    for name, param in b.named_parameters():  # the synced parameters are the (host) anchors
        assert torch.equal(param, sync_b.anchors[name])
    buffers_a, buffers_b = sync_a.momentum_buffers(), sync_b.momentum_buffers()
    assert buffers_a.keys() == buffers_b.keys() and all(torch.equal(buffers_a[k], buffers_b[k]) for k in buffers_a)
