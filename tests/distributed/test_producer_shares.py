"""Per-rank delivery (data.producer.per_rank): each trainer receives only its unit replica's block of every slot,
and a per-sample summary of the rest of the step; the samples, the loss normalizers and the bytes are checked
against a trainer that receives the whole global batch from the same producer."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from disttrain_core.data.producer import Layout, ProducerLoader, ProducerServer, job_identity
from disttrain_core.data.producer_protocol import FIELDS, StepSummary
from disttrain_core.data.transport import load_key, new_key

from .test_producer import PRODUCER_RUN

pytestmark = pytest.mark.distributed

FRAMING = 0.05  # what a share may carry beyond its own samples' tensor bytes: headers, tables, keys, summary


def own_bytes(slots) -> int:
    return sum(getattr(slot, name).numel() * getattr(slot, name).element_size() for slot in slots for name in FIELDS)


def counts(slots) -> list[float]:
    """What train/step_data.py normalizes the loss by, counted from whole slots."""
    return [
        float(sum(s.loss_tokens() for s in slots)),
        float(sum(s.gen_samples() for s in slots)),
        float(sum(s.size for s in slots)),
        float(sum(int(s.images.shape[0]) for s in slots)),
        float(sum(int(s.audio.shape[0]) for s in slots)),
        float(sum(int(s.video.shape[0]) for s in slots)),
    ]


def test_each_trainer_receives_its_block_and_the_summary_of_the_rest(compose_cfg):
    """An encoder unit of one replica (the whole slot) and an LLM unit of two (half a slot each, three trainers
    per half: first, middle and last stage of pp3), beside a trainer that takes the whole batch: every share
    equals that block of the whole batch, its summary gives the whole step's normalizers, and it costs its own
    samples' bytes plus under 5%; the middle stage receives no sample bytes."""
    cfg = compose_cfg("data.producer.timeout_s=20", "data.producer.workers=0")
    key = new_key()
    slots, per = 2, 8
    blocks = [range(0, per), range(0, 4), range(0, 4), range(4, 8), range(4, 8), range(4, 8)]
    middle = len(blocks) - 1  # a pipeline's middle stage: no field but the image counts
    layout = Layout(
        slots=slots,
        samples_per_slot=per,
        groups=2,
        stages=2,
        world=len(blocks) + 1,
        job=tuple(sorted(job_identity(cfg).items())),
    )
    server = ProducerServer(cfg, load_key(key), "127.0.0.1:0")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        whole = ProducerLoader(server.address, load_key(key), layout, {}, 20.0, 1 << 26)
        shares = [
            ProducerLoader(server.address, load_key(key), layout, {}, 20.0, 1 << 26, b, () if i == middle else None)
            for i, b in enumerate(blocks)
        ]
        for _ in range(3):
            reference = whole.next_step()
            for i, (loader, block) in enumerate(zip(shares, blocks, strict=True)):
                got = loader.next_step()
                assert len(got) == slots
                for mine, full in zip(got, reference, strict=True):
                    expected = full.select(block)
                    assert mine.keys == expected.keys
                    for name in FIELDS:
                        value, want = getattr(mine, name), getattr(expected, name)
                        if i == middle and name != "image_counts":
                            assert value.shape == want.shape and not value.any(), name
                        else:
                            assert torch.equal(value, want), name
                assert isinstance(loader.summary, StepSummary)
                assert loader.summary.totals() == counts(reference)
                assert loader.summary.image_counts.tolist() == [s.image_counts.tolist() for s in reference]
                assert loader.state_dict() == whole.state_dict()
                if i == middle:  # the summary and the framing: under 5% of what a sibling of its block receives
                    assert loader.bytes_received < FRAMING * shares[middle - 1].bytes_received
                    continue
                assert own_bytes(got) < loader.bytes_received <= (1 + FRAMING) * own_bytes(got)
            half = shares[1].bytes_received / whole.bytes_received
            assert 0.4 < half < 0.6, half  # half the samples, about half the bytes
        for loader in [whole, *shares]:
            loader.close()
    finally:
        server.close()


def test_a_block_outside_the_slot_is_refused(compose_cfg):
    cfg = compose_cfg("data.producer.timeout_s=5")
    key = new_key()
    layout = Layout(slots=1, samples_per_slot=4, groups=1, stages=1, world=1)
    layout = replace(layout, job=tuple(sorted(job_identity(cfg).items())))
    server = ProducerServer(cfg, load_key(key), "127.0.0.1:0")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(RuntimeError, match="refused this trainer: bad block in HELLO: \\[2, 6\\]"):
            ProducerLoader(server.address, load_key(key), layout, {}, 2.0, 1 << 26, block=range(2, 6))
        deadline = time.monotonic() + 5  # the server counts it after telling the trainer
        while server.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.rejected == 1
    finally:
        server.close()


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel=disagg2", "parallel.units.encoder.dp=2", "parallel.units.llm.dp=2", "trainer.devices=4"],
        ["parallel=pp2", "schedule=1f1b", "trainer.devices=4"],
    ],
    ids=["disagg_enc2_llm2", "pp2_dp2"],
)
def test_training_on_shares_equals_training_on_whole_batches(shards, tmp_path, layout, monkeypatch):
    """4 processes fed by a producer: each receiving only its block (and its stages' fields) trains exactly as
    each receiving the whole global batch (fp32 losses within 1e-5). In the disaggregated layout, also from a
    pool of two producers, one of which is killed once it has made step 2 (train.py starts it again on its
    address; the trainers reconnect from their positions)."""
    from ..conftest import cli_overrides, read_metrics, run_train

    common = [*layout, *PRODUCER_RUN]
    losses, received = {}, {}
    runs = {"true": ["data.producer.per_rank=true"], "false": ["data.producer.per_rank=false"]}
    if layout[0] == "parallel=disagg2":  # and from a pool of two producers, a data-parallel group each
        runs["pool"] = ["data.producer.count=2"]
    for name, overrides in runs.items():
        run_dir = tmp_path / name
        if name == "pool":
            monkeypatch.setenv("DISTTRAIN_FAULT", "kill@produce:rank=1:step=2")
        result = run_train(cli_overrides(shards, run_dir) + common + overrides)
        monkeypatch.delenv("DISTTRAIN_FAULT", raising=False)
        assert result.returncode == 0, result.stderr[-3000:]
        if name == "pool":
            output = result.stdout + result.stderr
            assert "data producer 1 of 2 (pid" in output and "starting it again on" in output, output[-3000:]
        metrics = [m for m in read_metrics(run_dir) if "loss" in m]
        losses[name] = [m["loss"] for m in metrics]
        received[name] = metrics[-1]["data/producer_bytes_per_step"]
    assert len(losses["true"]) == 3
    for name in runs:
        assert losses[name] == pytest.approx(losses["false"], abs=1e-5), name
    if "pool" in runs:
        assert received["pool"] == pytest.approx(received["true"], rel=0.01)  # the same block, from its producer
    # rank 0 (an encoder replica; a first stage) reads half of each slot and not every field
    assert received["true"] < 0.5 * received["false"], received
