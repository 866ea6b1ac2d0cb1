"""Data: deterministic DP-rank streams, exact resume, robust decoding, row layout."""

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from disttrain_core.config import SyntheticDataConfig, compose
from disttrain_core.data.loader import MicrobatchLoader
from disttrain_core.data.reader import Position, RawSample, ShardStream, resolve_shards
from disttrain_core.data.samples import BadSample, SampleEncoder, parse_segments
from disttrain_core.data.synthetic import make_sample
from disttrain_core.data.tokenizer import ByteTokenizer

from ..conftest import write_tar

TOK = ByteTokenizer()


def encoder(*overrides, max_pixels=64_000_000):
    return SampleEncoder(compose(list(overrides)).model, TOK, seed=0, max_image_pixels=max_pixels)


def keys_per_step(shards, dp_size, global_batch, steps):
    """The set of sample keys of each global step, read as dp_size ranks would."""
    per_rank = global_batch // dp_size
    streams = [ShardStream(shards, r, dp_size, seed=5).elements() for r in range(dp_size)]
    out = []
    for _ in range(steps):
        keys = set()
        for stream in streams:
            for _ in range(per_rank):
                keys.add(next(stream).item.key)
        out.append(keys)
    return out


def test_global_batches_do_not_depend_on_the_data_parallel_size(shards):
    files = resolve_shards(str(shards))
    one = keys_per_step(files, 1, 8, 20)  # 160 samples: crosses the 96-sample epoch boundary
    two = keys_per_step(files, 2, 8, 20)
    four = keys_per_step(files, 4, 8, 20)
    assert one == two == four
    assert all(len(step) == 8 for step in one)


def test_ranks_read_disjoint_shards(shards):
    files = resolve_shards(str(shards))
    a = ShardStream(files, 0, 2, seed=1).shards_for_epoch(3)
    b = ShardStream(files, 1, 2, seed=1).shards_for_epoch(3)
    assert set(a).isdisjoint(b) and len(a) + len(b) == len(files)


def test_more_ranks_than_shards_is_an_error(shards):
    with pytest.raises(ValueError, match="shards cannot feed"):
        ShardStream(resolve_shards(str(shards)), 0, 5, seed=0)


def _loader(shards, workers=0, state=None, enc=None):
    stream = ShardStream(resolve_shards(str(shards)), 0, 1, seed=2)
    return MicrobatchLoader(
        stream, enc or encoder(), micro_batch_size=3, microbatches_per_step=2, num_workers=workers, state=state
    )


def test_decode_workers_do_not_change_the_order(shards):
    inline, pooled = _loader(shards, 0), _loader(shards, 2)
    for _ in range(5):
        a, b = inline.next_step(), pooled.next_step()
        assert [mb.keys for mb in a] == [mb.keys for mb in b]
        assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b, strict=True))


def test_resume_from_saved_state_continues_with_the_same_samples(shards):
    reference = _loader(shards)
    for _ in range(3):
        reference.next_step()
    state = json.loads(json.dumps(reference.state_dict()))  # survives JSON, as in checkpoints
    resumed = _loader(shards, workers=1, state=state)
    for _ in range(4):
        assert [mb.keys for mb in reference.next_step()] == [mb.keys for mb in resumed.next_step()]


def test_synthetic_samples_are_deterministic_and_skewed():
    cfg = SyntheticDataConfig()
    assert make_sample(cfg, 17) == make_sample(cfg, 17)
    counts = [json.loads(make_sample(cfg, i)["json"])["images"] for i in range(400)]
    images = np.array([sum(x is not None for x in c) for c in counts])
    assert (images == 1).mean() > 0.3 and images.max() >= 5 and (images == 0).mean() > 0.01


# ----------------------------------------------------------------------------------- robustness
def _jpeg(side=40, color=(200, 10, 10)):
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), color).save(buffer, format="JPEG")
    return buffer.getvalue()


def test_bad_samples_are_skipped_and_counted(tmp_path):
    good = {"jpg": _jpeg(), "txt": b"a red square"}
    samples = [
        ("000", good),
        ("001", {"jpg": b"not an image at all", "txt": b"broken jpeg"}),
        ("002", {"json": b"{oops", "jpg": _jpeg()}),
        ("003", {"jpg": _jpeg(), "txt": b"   "}),
        ("004", {"jpg": _jpeg(side=300), "txt": b"a huge image"}),
        ("005", {"json": json.dumps({"texts": ["x", None], "images": [None, "0.png"]}).encode()}),
        ("006", good),
    ]
    write_tar(tmp_path / "a.tar", samples)
    with open(tmp_path / "a.tar", "rb") as f:
        data = f.read()
    (tmp_path / "b.tar").write_bytes(data[: len(data) // 2 + 100])  # a truncated shard
    enc = SampleEncoder(compose([]).model, TOK, seed=0, max_image_pixels=200 * 200)
    stream = ShardStream([str(tmp_path / "a.tar"), str(tmp_path / "b.tar")], 0, 1, seed=0, shuffle=False)
    loader = MicrobatchLoader(stream, enc, micro_batch_size=4, microbatches_per_step=1)
    batch = loader.next_step()[0]
    assert all(key.endswith(("/000", "/006")) for key in batch.keys)
    skipped = loader.state_dict()["skipped"]
    for reason in ("bad_image", "bad_json", "empty_text", "huge_image", "missing_image", "shard_error"):
        assert skipped.get(reason, 0) >= 1, (reason, skipped)


def test_accepted_layouts():
    jpg = _jpeg()
    assert [k for k, _ in parse_segments({"jpg": jpg, "txt": b"cap"})] == ["text", "image"]
    assert [k for k, _ in parse_segments({"webp": jpg, "json": b'{"caption": "cap"}'})] == ["text", "image"]
    assert [k for k, _ in parse_segments({"txt": b"only text"})] == ["text"]
    interleaved = {
        "json": json.dumps({"texts": ["a", None, "b"], "images": [None, "0.jpg", None]}).encode(),
        "0.jpg": jpg,
    }
    assert [k for k, _ in parse_segments(interleaved)] == ["text", "image", "text"]
    with pytest.raises(BadSample):
        parse_segments({"jpg": jpg})  # no caption at all


# ---------------------------------------------------------------------------------- row layout
def test_row_layout_places_generation_tokens_before_the_last_image():
    enc = encoder()
    cfg = compose([]).model
    members = make_sample(SyntheticDataConfig(), 3)
    n_images = sum(x is not None for x in json.loads(members["json"])["images"])
    row = enc.encode("k", members)
    tokens = row.tokens
    patches = enc.image_tokens
    assert tokens.shape == (cfg.seq_len,) and tokens[0] == TOK.bos_id
    kept = row.images.shape[0]
    assert kept + row.truncated_images == n_images
    assert (tokens == TOK.image_id).sum() == kept * patches
    gen_positions = np.flatnonzero(tokens == TOK.gen_id)
    assert len(gen_positions) == cfg.gen_tokens
    last_image_start = np.flatnonzero(tokens == TOK.image_id)[-patches]
    assert gen_positions[-1] + 1 == last_image_start
    # Labels: only next text tokens, never placeholders.
    valid = row.labels != -100
    assert np.all((row.labels[valid] < 256) | (row.labels[valid] == TOK.eos_id))
    assert row.gen_weight == 1.0 and row.gen_image.shape == (3, cfg.gen_image_size, cfg.gen_image_size)


def test_long_samples_are_truncated_without_cutting_an_image():
    enc = encoder("model.seq_len=64")
    members = {
        "json": json.dumps(
            {"texts": ["ab" * 5, None, "cd" * 30, None], "images": [None, "0.jpg", None, "1.jpg"]}
        ).encode(),
        "0.jpg": _jpeg(),
        "1.jpg": _jpeg(),
    }
    row = enc.encode("k", members)
    assert row.images.shape[0] == 1 and row.truncated_images == 1
    assert (row.tokens == TOK.image_id).sum() == enc.image_tokens


def test_noise_is_seeded_by_the_sample_not_the_process():
    a = encoder().encode("shard/7", make_sample(SyntheticDataConfig(), 7))
    b = encoder().encode("shard/7", make_sample(SyntheticDataConfig(), 7))
    c = encoder().encode("shard/8", make_sample(SyntheticDataConfig(), 7))
    assert np.array_equal(a.gen_noise, b.gen_noise) and a.gen_timestep == b.gen_timestep
    assert not np.array_equal(a.gen_noise, c.gen_noise)


def test_position_replay_skips_exactly(shards):
    files = resolve_shards(str(shards))
    stream = ShardStream(files, 0, 1, seed=9)
    everything = [e.item.key for _, e in zip(range(120), stream.elements(), strict=False)]
    restarted = [e.item.key for _, e in zip(range(50), stream.elements(Position(0, 70)), strict=False)]
    assert restarted == everything[70:120]
    assert isinstance(next(stream.elements()).item, RawSample)


# ------------------------------------------------------------------------------ open shard files
def _stream_keys(files, dp_size, max_open, count):
    out = []
    for rank in range(dp_size):
        stream = ShardStream(files, rank, dp_size, seed=4, max_open=max_open).elements()
        out.append([e.item.key for _, e in zip(range(count), stream, strict=False)])
    return out


def test_open_shard_files_are_bounded_and_the_order_does_not_depend_on_the_bound(shards, monkeypatch):
    from disttrain_core.data import shard_cursor

    opened = []
    open_file = shard_cursor._open_file

    def tracked(path):
        opened.append(open_file(path))
        return opened[-1]

    monkeypatch.setattr(shard_cursor, "_open_file", tracked)
    files = resolve_shards(str(shards))  # 4 shards x 24 samples
    most = 0
    for element, _ in zip(ShardStream(files, 0, 1, seed=4, max_open=2).elements(), range(200), strict=False):
        assert isinstance(element.item, RawSample)
        most = max(most, sum(not f.closed for f in opened))
    assert most == 2 and len(opened) > 100  # shards were closed and reopened at their next sample
    for dp_size in (1, 2):  # crosses the 96-sample epoch boundary
        assert _stream_keys(files, dp_size, 1, 120) == _stream_keys(files, dp_size, 16, 120)
    assert all(f.closed for f in opened)


def test_running_out_of_file_descriptors_is_an_error_not_a_skipped_shard(shards):
    """With the process's descriptors used up, opening a shard raises FileDescriptorsExhausted (naming the
    limit) instead of yielding a ShardError that the loader would count and skip."""
    import subprocess
    import sys

    script = f"""
import os, resource
from disttrain_core.data.reader import FileDescriptorsExhausted, ShardStream, resolve_shards
stream = ShardStream(resolve_shards({str(shards)!r}), 0, 1, seed=0).elements()
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
held = []
try:
    while True:
        held.append(open(os.devnull))
except OSError:
    pass
try:
    print("read", next(stream).item)
except FileDescriptorsExhausted as error:
    print("exhausted:", error)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("exhausted: cannot open shard"), done.stdout + done.stderr
    assert "ulimit -n" in done.stdout and "\n" not in done.stdout.strip()


def test_compressed_shards_read_as_the_plain_ones(shards, tmp_path):
    import gzip

    files = resolve_shards(str(shards))[:2]
    packed = []
    for path in files:
        packed.append(str(tmp_path / (Path(path).name + ".gz")))
        Path(packed[-1]).write_bytes(gzip.compress(Path(path).read_bytes()))

    def samples(paths):
        stream = ShardStream(paths, 0, 1, seed=0, shuffle=False, max_open=1)  # every read reopens at an offset
        return [(Path(e.item.key).name, e.item.members) for e in stream.epoch_elements(0)]

    assert samples(packed) == samples(files) and len(samples(files)) == 48


def test_a_truncated_member_loses_its_own_sample_not_the_one_before(tmp_path):
    """webdataset's grouping reads one member ahead; the reader fills that member's bytes only when the
    member after it is asked for, so the sample before a break is complete and kept."""
    samples = [(f"{i:03d}", {"txt": f"caption {i}".encode(), "json": b"{}"}) for i in range(4)]
    write_tar(tmp_path / "a.tar", samples)
    with tarfile.open(tmp_path / "a.tar") as tar:  # cut inside sample 002's first member's bytes
        cut = next(m for m in tar.getmembers() if m.name == "002.txt").offset_data + 3
    (tmp_path / "b.tar").write_bytes((tmp_path / "a.tar").read_bytes()[:cut])
    items = [e.item for e in ShardStream([str(tmp_path / "b.tar")], 0, 1, seed=0).epoch_elements(0)]
    assert [getattr(i, "key", None) for i in items[:2]] == ["b.tar/000", "b.tar/001"]
    assert items[1].members == {"txt": b"caption 1", "json": b"{}"}
    assert len(items) == 3 and items[2].reason.startswith("ReadError"), items[2:]
    whole = [e.item.key for e in ShardStream([str(tmp_path / "a.tar")], 0, 1, seed=0).epoch_elements(0)]
    assert whole == [f"a.tar/{i:03d}" for i in range(4)]
