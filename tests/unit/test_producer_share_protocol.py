"""What a trainer asks of every step (HELLO ``block`` and ``fields``) and the share frame it gets back: bad
requests and bad frames are ProtocolErrors naming the value, never another exception."""

from __future__ import annotations

import pytest
import torch

from disttrain_core.data.batch import Batch
from disttrain_core.data.producer_protocol import (
    FIELDS,
    Layout,
    StepSummary,
    Want,
    decode_share,
    encode_share,
    parse_hello,
)
from disttrain_core.data.transport import ProtocolError

LAYOUT = Layout(slots=2, samples_per_slot=4, groups=1, stages=1, world=1).to_dict()


def hello(**extra) -> dict:
    return {"layout": LAYOUT, "start": {}, "trainer": "t", **extra}


def batch(rows: int = 8) -> Batch:
    counts = torch.tensor([1, 0, 2, 0, 0, 1, 1, 0])[:rows]
    labels = torch.full((rows, 6), -100)
    labels[:, :3] = 7
    labels[0, :] = 7
    return Batch(
        tokens=torch.arange(rows * 6).reshape(rows, 6),
        labels=labels,
        images=torch.arange(int(counts.sum()) * 12, dtype=torch.uint8).reshape(-1, 3, 2, 2),
        image_counts=counts,
        gen_images=torch.ones(rows, 3, 2, 2, dtype=torch.uint8),
        gen_weight=torch.tensor([1.0, 0.0] * (rows // 2)),
        gen_noise=torch.randn(rows, 1, 2, 2),
        gen_timesteps=torch.arange(rows),
        keys=[f"k{i}" for i in range(rows)],
    )


def test_a_hello_names_a_block_inside_the_slot_and_known_fields():
    assert parse_hello(hello())[4] is None
    want = parse_hello(hello(block=[1, 3], fields=["labels"]))[4]
    counts = ("image_counts", "audio_counts", "video_counts")
    assert want == Want(range(1, 3), ("labels", *counts)) == Want.of(range(1, 3), ("labels",))
    assert parse_hello(hello(block=[0, 4]))[4].fields == FIELDS
    for bad, match in [
        ({"block": [2, 2]}, r"bad block in HELLO: \[2, 2\] \(slots of 4 samples\)"),
        ({"block": [0, 5]}, r"bad block"),
        ({"block": "0:2"}, r"bad block"),
        ({"block": [0, 2], "fields": ["pixels"]}, r"bad fields in HELLO: \['pixels'\] \(choose from tokens"),
        ({"block": [0, 2], "fields": "tokens"}, r"bad fields"),
    ]:
        with pytest.raises(ProtocolError, match=match):
            parse_hello(hello(**bad))


def test_a_share_round_trips_and_its_summary_counts_the_whole_step():
    whole = batch()
    want = Want.of(range(1, 3), ("tokens",))
    meta, payload = encode_share(whole, 2, want)
    slots, summary = decode_share(meta, bytearray(payload), 2, 4, want, 1 << 20)
    assert [s.keys for s in slots] == [["k1", "k2"], ["k5", "k6"]]
    assert torch.equal(slots[1].tokens, whole.tokens[5:7]) and torch.equal(slots[0].image_counts, torch.tensor([0, 2]))
    assert slots[0].images.shape == (2, 3, 2, 2) and not slots[0].images.any()  # not wanted: zeros, right shape
    # ... held as one zero, expanded: neither materialized on the host nor copied whole to the device
    from disttrain_core.data.batch import is_absent
    from disttrain_core.train.engine import batch_to_device

    moved = batch_to_device(slots[0], torch.device("cpu"))
    assert is_absent(slots[0].images) and is_absent(moved.labels) and moved.labels.untyped_storage().nbytes() == 8
    assert not is_absent(moved.tokens) and torch.equal(moved.tokens, slots[0].tokens)
    assert not slots[0].labels.any() and slots[0].labels.shape == (2, 6)
    assert summary.totals() == [float((whole.labels != -100).sum()), 4.0, 8.0, 5.0, 0.0, 0.0]  # no clips, no video
    assert torch.equal(summary.image_counts, whole.image_counts.view(2, 4))
    assert StepSummary.of(whole, 2).image_counts.shape == (2, 4)


def test_a_bad_share_frame_is_a_protocol_error():
    whole = batch()
    want = Want.of(range(0, 2), ("tokens",))
    meta, payload = encode_share(whole, 2, want)
    cases = [
        ({**meta, "block": [0, 3]}, 1 << 20, "a share of block"),
        ({**meta, "fields": ["labels"]}, 1 << 20, "a share of block"),
        ({**meta, "absent": {}}, 1 << 20, "a share that leaves out"),
        ({**meta, "absent": {**meta["absent"], "images": [1 << 40, 3, 2, 2]}}, 1 << 20, "exceed the limit"),
        ({**meta, "absent": {**meta["absent"], "images": "big"}}, 1 << 20, "bad shape of absent field images"),
        ({**meta, "absent": {**meta["absent"], "images": [9, 3, 2, 2]}}, 1 << 20, "image counts do not match"),
        (meta, 10, "exceed the limit of 10"),
    ]
    for bad, limit, match in cases:
        with pytest.raises(ProtocolError, match=match):
            decode_share(bad, bytearray(payload), 2, 4, want, limit)
    tables = [dict(t) for t in meta["tensors"]]
    bad = bytearray(payload)
    entry = next(t for t in tables if t["name"] == "summary_image_counts")
    bad[entry["offset"]] = 9  # one sample's image count no longer adds up to its slot's total
    with pytest.raises(ProtocolError, match="image or clip counts disagree with its totals"):
        decode_share(meta, bad, 2, 4, want, 1 << 20)
    bad = bytearray(payload)  # the per-sample clip counts (the broker routes the audio units' rows by them)
    bad[next(t for t in tables if t["name"] == "summary_clip_counts")["offset"]] = 9
    with pytest.raises(ProtocolError, match="image or clip counts disagree with its totals"):
        decode_share(meta, bad, 2, 4, want, 1 << 20)
    bad = bytearray(payload)  # a negative frame-group count (the broker routes the video unit's rows by them)
    entry = next(t for t in tables if t["name"] == "summary_group_counts")
    bad[entry["offset"] : entry["offset"] + 4] = (-1).to_bytes(4, "little", signed=True)
    with pytest.raises(ProtocolError, match="negative frame-group counts"):
        decode_share(meta, bad, 2, 4, want, 1 << 20)
    with pytest.raises(ProtocolError, match="step summary not of 2 slots x 8"):
        decode_share(meta, bytearray(payload), 2, 8, Want.of(range(0, 2), ("tokens",)), 1 << 20)
