"""Pieces of trainer.fault_tolerance that need no second process: live recovery's wire (authenticated, no pickle),
the Lighthouse check before launch, and how a step's microbatches are shared by the groups of a quorum."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from disttrain_core.base.launch_env import LaunchError
from disttrain_core.base.net import free_port
from disttrain_core.launch.replica_groups import lighthouse_reachable, start_lighthouse
from disttrain_core.train.fault_tolerance.transport import HealTransport, decode, encode

KEY = b"k" * 32


def test_a_state_travels_whole_between_groups_and_only_to_the_key_holder():
    source, joiner, stranger = HealTransport(KEY), HealTransport(KEY), HealTransport(b"x" * 32)
    state = {
        "user": {"default": {"tensors": {"w": torch.randn(3, 4), "b": torch.arange(5)}, "data": {"index": 7}}},
        "torchft": {"step": 9, "batches_committed": 27},
        "lists": [1, 2.5, float("inf"), None, "text", True],
    }
    # the joiner may ask before the source was told to send: it waits for the snapshot
    sender = threading.Timer(0.2, source.send_checkpoint, ([1], 9, state, timedelta(seconds=5)))
    sender.start()
    got = joiner.recv_checkpoint(0, source.metadata(), 9, timedelta(seconds=5))
    sender.join()
    assert torch.equal(got["user"]["default"]["tensors"]["w"], state["user"]["default"]["tensors"]["w"])
    assert torch.equal(got["user"]["default"]["tensors"]["b"], state["user"]["default"]["tensors"]["b"])
    assert got["torchft"] == state["torchft"] and got["lists"] == state["lists"]
    assert source.sent == 1
    with pytest.raises(ConnectionError):  # another key: the source drops the connection unanswered
        stranger.recv_checkpoint(0, source.metadata(), 9, timedelta(seconds=5))
    source.disallow_checkpoint()  # withdrawn after the commit vote: a late request is refused, not served stale
    with pytest.raises(RuntimeError, match="no state of step 9"):
        joiner.recv_checkpoint(0, source.metadata(), 9, timedelta(seconds=1))
    assert source.sent == 1
    for transport in (source, joiner, stranger):
        transport.shutdown()


def test_the_state_tree_is_json_and_tensors_only():
    tree, tensors = encode({"a": [torch.ones(2), {"b": float("nan")}]})
    assert tree == {"a": [{"__tensor__": "0"}, {"b": {"__float__": "nan"}}]}
    assert torch.equal(decode(tree, tensors)["a"][0], torch.ones(2))
    with pytest.raises(TypeError, match="cannot send a object"):
        encode({"a": object()})
    with pytest.raises(TypeError, match="state keys must be strings"):
        encode({1: torch.ones(1)})


def test_an_unreachable_lighthouse_is_one_line_within_2_s():
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        lighthouse_reachable(address)
    assert time.monotonic() - started < 2.5
    message = str(info.value)
    assert "\n" not in message and f"trainer.fault_tolerance.lighthouse={address}" in message
    assert "within 2 s" in message and "torchft_lighthouse --bind" in message


def test_the_lighthouse_train_py_starts_listens_on_the_loopback_and_answers_the_check():
    from omegaconf import OmegaConf

    from disttrain_core.config.fault_tolerance import FaultToleranceConfig

    server, address = start_lighthouse(OmegaConf.structured(FaultToleranceConfig()), 2)
    try:
        assert address.startswith("127.0.0.1:")
        lighthouse_reachable(address)
    finally:
        server.shutdown()


class _Quorum:
    def __init__(self, rank, count):
        self.rank, self.count = rank, count

    def participating_rank(self):
        return self.rank

    def num_participants(self):
        return self.count


@pytest.mark.parametrize("participants", [4, 3, 2])
def test_a_step_is_shared_whole_by_the_groups_of_its_quorum(participants):
    from disttrain_core.train.fault_tolerance.replica import ReplicaGroupMember

    microbatches = list(range(4))
    shares = []
    for rank in range(participants):
        member = ReplicaGroupMember.__new__(ReplicaGroupMember)
        member.manager, member.workers = _Quorum(rank, participants), None
        shares.append(member.share(microbatches))
    assert [m for share in shares for m in share] == microbatches  # none lost, none twice, in order
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_a_group_rank_that_raises_says_one_line_and_keeps_its_traceback(tmp_path, capsys):
    from disttrain_core.launch.replica_groups import _report_failure

    environ = {"DISTTRAIN_FT_REPLICA": "2", "RANK": "1", "DISTTRAIN_FT_START": "3"}
    try:
        raise RuntimeError("[pair.cc:537] Read error: Connection reset by peer\nsecond line")
    except RuntimeError as error:
        import traceback

        _report_failure(error, traceback.format_exc(), str(tmp_path), environ)
    saved = tmp_path / "replicas" / "r2" / "error_rank1_start3.txt"
    assert "Traceback (most recent call last)" in saved.read_text()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("replica group 2 rank 1 failed: RuntimeError: [pair.cc:537] Read error: Connection reset")
    assert str(saved) in err
