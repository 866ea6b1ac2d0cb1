"""NCCL's point-to-point contract, enforced on gloo (DISTTRAIN_STRICT_P2P=1, set for the whole suite):
one handle per batch_isend_irecv call, received data valid only once that handle is waited on; and an
executor that files handles by position instead of waiting on each is caught by it."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from disttrain_core.config import compose

from .pipeline_reference import reference
from .pipeline_worker import main as pipeline_worker
from .spawn import start_processes

pytestmark = pytest.mark.distributed


def _p2p_worker(rank: int, store: str, out: str) -> None:
    from disttrain_core.comm.p2p import post, strict

    dist.init_process_group(
        "gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    peer = 1 - rank
    mine = torch.arange(4, dtype=torch.float32) + 10 * rank
    theirs = torch.zeros(4)
    works = post([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)])
    before = theirs.clone()  # what a reader that skipped the wait sees
    for work in works:
        work.wait()
    torch.save({"strict": strict(), "handles": len(works), "before": before, "after": theirs}, f"{out}/{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_a_call_returns_one_handle_and_its_data_lands_on_wait(tmp_path):
    assert os.environ.get("DISTTRAIN_STRICT_P2P") == "1"  # conftest: the suite runs under NCCL's contract
    start_processes(_p2p_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        result = torch.load(tmp_path / f"{rank}.pt", weights_only=True)
        assert result["strict"] and result["handles"] == 1
        assert torch.isnan(result["before"]).all()
        assert torch.equal(result["after"], torch.arange(4, dtype=torch.float32) + 10 * (1 - rank))


MODEL = ["model.llm.n_layers=4", "model.llm.dim=64", "model.llm.ffn_dim=128", "model.seq_len=96", "trainer.seed=3"]


@pytest.mark.parametrize("wait", ["every_handle", "skip_first_handle"])
def test_an_executor_that_skips_a_handle_trains_on_garbage(wait, shards, tmp_path):
    """The bug NCCL would have hidden on gloo: assuming the first handle of a call is someone else's."""
    out = tmp_path / "out"
    out.mkdir()
    cases = [("1f1b", 1)]
    start_processes(
        pipeline_worker,
        args=(2, str(tmp_path / "store"), str(out), str(shards), MODEL, cases, wait == "skip_first_handle"),
        nprocs=2,
    )
    _, ref_grads = reference(compose([f"data.path={shards}"] + MODEL))
    grads = {}
    for rank in (0, 1):
        grads.update(torch.load(out / f"1f1b_v1_rank{rank}.pt", weights_only=True)["grads"])
    worst = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
    if wait == "every_handle":
        assert worst < 1e-5
    else:
        assert not worst < 1e-3  # NaN (never written) or wrong
