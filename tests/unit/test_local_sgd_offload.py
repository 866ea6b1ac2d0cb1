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


def test_fsdp2_shards_offloaded_equal_the_device_ones_and_checkpoint_through_their_host_anchors(tmp_path):
    """A one-process FSDP2 worker (zero3 over a 1-rank gloo mesh): the sharded outer step with host anchors gives the
    parameters of the one without, and the anchors checkpoint as DTensors placed like the parameters over the host
    tensors themselves (WorkerShards.like_parameter): a DCP load writes into the host anchors. On this CPU both
    placements share memory (the arithmetic and the bookkeeping are checked, not a transfer)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from disttrain_core.config import compose
    from disttrain_core.train.local_sgd.shards import WorkerShards

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        cfg = compose(["parallel=local_sgd", "parallel.shard=zero3", "trainer.precision=32"])
        shards = WorkerShards(cfg, torch.device("cpu"), None, 0, 0, 1)
        models, syncs = [], []
        for offload in (False, True):
            torch.manual_seed(0)
            model = Tiny()
            assert shards.apply(model)
            named = list(model.named_parameters())
            assert all(isinstance(p, DTensor) for _, p in named)
            outer = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
            owner = dict.fromkeys((n for n, _ in named), 0)
            sync = OuterSync(model, named, owner, 0, 0, None, None, 1, 1, outer, False, offload=offload, sharded=True)
            models.append(model)
            syncs.append(sync)
        for round_ in range(2):
            with torch.no_grad():
                for pa, pb in zip(models[0].parameters(), models[1].parameters(), strict=True):
                    drift = torch.randn_like(pa.to_local()) * 0.1 * (round_ + 1)
                    pa.to_local().add_(drift)
                    pb.to_local().add_(drift)
            for sync in syncs:
                sync.sync_now()
        for pa, pb in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert torch.equal(pa.to_local(), pb.to_local())
        sync, params = syncs[1], dict(models[1].named_parameters())
        state = {n: shards.like_parameter(params[n], a.detach()) for n, a in sync.anchors.items()}
        for name, entry in state.items():
            assert entry.to_local().data_ptr() == sync.anchors[name].data_ptr()  # the host anchor itself
        saved = {n: a.detach().clone() for n, a in sync.anchors.items()}
        dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
        with torch.no_grad():
            for anchor in sync.anchors.values():
                anchor.zero_()
        dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
        assert all(torch.equal(sync.anchors[n], saved[n]) for n in saved)
    finally:
        dist.destroy_process_group()
