"""data.format=hf (data/hf_source.py): parquet, arrow and jsonl.gz files written here read as members dicts; the
replicas split one seeded row order; a position replays the rest exactly (mapped and streaming); unusable rows are
skipped and counted by reason; a local HTTP server serves the same rows; validation names a missing column."""

import functools
import gzip
import http.server
import io
import itertools
import json
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from PIL import Image

from disttrain_core.config import compose, typed_config
from disttrain_core.config.schema import DataConfig
from disttrain_core.data.blend import BlendedStream, open_stream
from disttrain_core.data.hf_source import HFStream
from disttrain_core.data.loader import MicrobatchLoader
from disttrain_core.data.reader import Position
from disttrain_core.data.samples import SampleEncoder
from disttrain_core.data.tokenizer import tokenizer_for
from disttrain_core.planner.fit import validate_run
from disttrain_core.validation import ConfigError
from disttrain_core.validation.hf_data import check_hf

from .test_storage import RangeHandler

TEXTS = [f"document {i}: the quick brown fox jumps over the lazy dog" for i in range(12)]


def png(shade: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (20, 12), (shade, 40, 200 - shade)).save(out, "PNG")
    return out.getvalue()


def write(directory, kind: str, rows: list[dict]) -> str:
    path = directory / f"rows.{kind}"
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif kind == "arrow":  # the IPC stream format datasets' save_to_disk writes
        table = pa.Table.from_pylist(rows)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    else:
        with gzip.open(path, "wt") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


def data_cfg(path: str, tmp_path, **hf):
    cfg = OmegaConf.structured(DataConfig)
    cfg.name, cfg.format, cfg.path = "hf", "hf", path
    cfg.hf.cache_dir = str(tmp_path / "cache")
    for key, value in hf.items():
        OmegaConf.update(cfg.hf, key, value, merge=False)
    return cfg


def take(stream, n: int, start: Position = Position()):
    return [(e.position, e.item.key, e.item.members) for e in itertools.islice(stream.elements(start), n)]


@pytest.mark.parametrize("kind", ["parquet", "arrow", "jsonl.gz"])
def test_each_kind_reads_its_rows_in_order_when_unshuffled(tmp_path, kind):
    path = write(tmp_path, kind, [{"text": t, "other": 1} for t in TEXTS])
    stream = HFStream(data_cfg(path, tmp_path), seed=0, shuffle=False)
    got = take(stream, 14)
    assert [m["txt"].decode() for _, _, m in got] == TEXTS + TEXTS[:2]  # then epoch 1
    assert got[12][0] == Position(1, 0) and all(set(m) == {"txt"} for _, _, m in got)


@pytest.mark.parametrize("replicas", [2, 3])
def test_replicas_read_disjoint_parts_of_one_seeded_order(tmp_path, replicas):
    cfg = data_cfg(write(tmp_path, "parquet", [{"text": t} for t in TEXTS]), tmp_path)
    canonical = [key for _, key, _ in take(HFStream(cfg, seed=5), 12)]
    assert sorted(canonical) != canonical and sorted(canonical) == sorted(f"hf:{i}" for i in range(12))
    assert canonical != [key for _, key, _ in take(HFStream(cfg, seed=6), 12)]  # the seed orders the rows
    parts = [[key for _, key, _ in take(HFStream(cfg, 5, r, replicas), 12 // replicas)] for r in range(replicas)]
    for r, part in enumerate(parts):  # replica r's l-th row is the one order's row l*D + r
        assert part == canonical[r::replicas]


def test_streaming_replicas_are_disjoint_and_cover_the_rows(tmp_path):
    cfg = data_cfg(write(tmp_path, "jsonl.gz", [{"text": t} for t in TEXTS]), tmp_path, streaming=True)
    parts = [[m["txt"].decode() for _, _, m in take(HFStream(cfg, 3, r, 2), 6)] for r in range(2)]
    assert sorted(parts[0] + parts[1]) == sorted(TEXTS)
    again = [m["txt"].decode() for _, _, m in take(HFStream(cfg, 3, 0, 2), 6)]
    assert again == parts[0]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_position_replays_the_rest_exactly(tmp_path, streaming):
    cfg = data_cfg(write(tmp_path, "parquet", [{"text": t} for t in TEXTS]), tmp_path, streaming=streaming)
    n = 8 if streaming else 20  # a streaming epoch takes seconds to start: two epochs, one cut
    whole = take(HFStream(cfg, 9, 1, 2), n)  # epochs of six rows, reshuffled each epoch
    assert [m for _, _, m in whole[:2]] != [m for _, _, m in whole[6:8]]
    for cut in (4,) if streaming else (4, 6, 9):
        assert take(HFStream(cfg, 9, 1, 2), n - cut, whole[cut][0]) == whole[cut:]


def test_unusable_rows_are_skipped_and_counted_by_reason(tmp_path, compose_cfg):
    (tmp_path / "pictures").mkdir()
    (tmp_path / "pictures" / "ok.png").write_bytes(png(90))
    good = [{"caption": t, "image": {"bytes": png(10 * i), "path": None}} for i, t in enumerate(TEXTS[:4])]
    rows = (
        good[:2]
        + [
            {"caption": None, "image": {"bytes": png(1), "path": None}},  # missing_value
            {"caption": "an undecodable image", "image": {"bytes": b"not an image", "path": None}},  # bad_image
            {"caption": "a path that is not there", "image": {"bytes": None, "path": "pictures/gone.png"}},
            {"caption": "a path that is", "image": {"bytes": None, "path": "pictures/ok.png"}},
            {"caption": "   ", "image": {"bytes": png(3), "path": None}},  # empty_text
        ]
        + good[2:]
    )
    path = write(tmp_path, "parquet", rows)
    cfg = data_cfg(path, tmp_path, columns={"text": "caption", "image": "image"})
    model = compose_cfg("model=mllm_tiny").model
    encoder = SampleEncoder(model, tokenizer_for(compose_cfg("model=mllm_tiny")), 0, 10**7)
    loader = MicrobatchLoader(HFStream(cfg, 0, shuffle=False), encoder, micro_batch_size=5, microbatches_per_step=1)
    (batch,) = loader.next_step()
    assert batch.keys == ["hf:0", "hf:1", "hf:5", "hf:7", "hf:8"]
    assert list(batch.image_counts) == [1] * 5
    assert dict(loader.skipped) == {"missing_value": 1, "bad_image": 1, "missing_image": 1, "empty_text": 1}
    assert loader.state_dict()["index"] == 9
    wrong = data_cfg(write(tmp_path, "jsonl.gz", [{"c": "not json ["}, {"c": '{"turns": 1}'}]), tmp_path)
    OmegaConf.update(wrong, "hf.columns", {"text": None, "conversations": "c"}, merge=False)
    items = [e.item for e in itertools.islice(HFStream(wrong, 0, shuffle=False).elements(), 2)]
    assert [(i.reason, "conversations" in i.detail) for i in items] == [("bad_value", True), ("bad_value", True)]


@pytest.fixture
def served(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(RangeHandler, directory=tmp_path))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("streaming", [False, True])
def test_rows_behind_http_equal_the_local_rows(tmp_path, served, streaming):
    write(tmp_path, "parquet", [{"text": t} for t in TEXTS])
    local = take(HFStream(data_cfg(str(tmp_path / "rows.parquet"), tmp_path, streaming=streaming), 2, 0, 2), 8)
    remote = take(HFStream(data_cfg(f"{served}/rows.parquet", tmp_path, streaming=streaming), 2, 0, 2), 8)
    assert [m for _, _, m in remote] == [m for _, _, m in local] and len(local) == 8


def test_validation_names_a_missing_column_and_a_path_without_files(tmp_path, compose_cfg):
    path = write(tmp_path, "parquet", [{"text": t, "url": "x"} for t in TEXTS])
    cfg = compose_cfg("model=mllm_tiny", "data=hf", f"data.path={path}", "data.hf.columns.image=jpg")
    with pytest.raises(ConfigError) as error:
        check_hf(cfg)
    assert str(error.value) == (
        f"data.hf.columns.image='jpg': {path} has no such column; its columns are ['text', 'url']"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = compose_cfg("model=llama_tiny", "data=hf", f"data.path={empty}")
    with pytest.raises(ConfigError, match=r"names no \.parquet, \.arrow or \.jsonl\(\.gz\) file") as error:
        check_hf(cfg)
    assert "\n" not in str(error.value)
    check_hf(compose_cfg("model=llama_tiny", "data=hf", f"data.path={tmp_path}/*.parquet"))  # a glob that reads
    (tmp_path / "b.parquet").write_bytes((tmp_path / "rows.parquet").read_bytes())
    braces = f"{tmp_path}/{{rows,b,c}}.parquet"  # C4-style names: a brace pattern; c.parquet is missing
    with pytest.raises(ConfigError) as error:
        check_hf(compose_cfg("model=llama_tiny", "data=hf", f"data.path='{braces}'"))
    assert str(error.value) == (
        f"data.path={braces!r} names 1 file(s) that are missing or of no known kind (first: {tmp_path}/c.parquet); "
        "fix the pattern, or point data.path at the directory"
    )
    check_hf(compose_cfg("model=llama_tiny", "data=hf", f"data.path='{tmp_path}/{{rows,b}}.parquet'"))


def test_validation_of_a_held_out_split(tmp_path, compose_cfg):
    """data=hf's held-out split is files of their own (data.val.path), checked as data.path is; shards held out of
    data.path, no split at all, or the training files again are one line each."""
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    train = write(tmp_path / "train", "parquet", [{"text": t} for t in TEXTS])
    held = write(tmp_path / "val", "parquet", [{"caption": t} for t in TEXTS])
    base = ["model=llama_tiny", "data=hf", f"data.path={train}", "trainer.val_every_n_steps=2"]
    cases = {
        "data.val.holdout_shards=1": "data.val.holdout_shards=1 holds out webdataset shards; with data=hf give the "
        "held-out rows as files of their own: data.val.path=<parquet, arrow or jsonl files>",
        "data.val.path=null": "trainer.val_every_n_steps=2 evaluates on held-out data, and data.val names none: set "
        "data.val.path=<held-out parquet, arrow or jsonl files>",
        f"data.val.path={train}": f"data.val.path={train!r} shares 1 file(s) with the training files (first: "
        f"{train}): a held-out split is never trained on",
        f"data.val.path={held}": f"data.hf.columns.text='text': {held} has no such column; its columns are ['caption']",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as error:
            check_hf(compose_cfg(*base, override))
        assert str(error.value) == message, override
    write(tmp_path / "val", "parquet", [{"text": t} for t in TEXTS])
    check_hf(compose_cfg(*base, f"data.val.path={held}"))


def test_audio_columns_become_clips_of_the_audio_tower(tmp_path, compose_cfg):
    """data.hf.columns.audio: bytes, datasets' {bytes, path} struct or a path, named by their format (FLAC, WAV, OGG)
    and read by the audio tower as a clip; a path that is not there is a counted missing_audio; a model without a
    tower is refused in one line."""
    import soundfile

    def clip(fmt: str) -> bytes:
        buffer = io.BytesIO()
        soundfile.write(buffer, np.sin(np.arange(8000) / 5).astype(np.float32) * 0.5, 16000, format=fmt)
        return buffer.getvalue()

    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "a.wav").write_bytes(clip("WAV"))
    rows = [
        {"caption": "a tone in flac", "audio": {"bytes": clip("FLAC"), "path": None}},
        {"caption": "a clip that is not there", "audio": {"bytes": None, "path": "clips/gone.flac"}},
        {"caption": "a tone in ogg", "audio": {"bytes": clip("OGG"), "path": None}},
        {"caption": "a wav on disk", "audio": {"bytes": None, "path": "clips/a.wav"}},
    ]
    cfg = data_cfg(write(tmp_path, "parquet", rows), tmp_path, columns={"text": "caption", "audio": "audio"})
    items = [e.item for e in itertools.islice(HFStream(cfg, 0, shuffle=False).elements(), 4)]
    assert [sorted(items[i].members) for i in (0, 2, 3)] == [["flac", "txt"], ["ogg", "txt"], ["txt", "wav"]]
    assert items[1].reason == "missing_audio"
    model = compose_cfg("model=any2any_tiny").model
    encoder = SampleEncoder(model, tokenizer_for(compose_cfg("model=any2any_tiny")), 0, 10**7)
    loader = MicrobatchLoader(HFStream(cfg, 0, shuffle=False), encoder, micro_batch_size=3, microbatches_per_step=1)
    (batch,) = loader.next_step()
    assert list(batch.audio_counts) == [1, 1, 1] and batch.audio.shape[0] == 3
    assert dict(loader.skipped) == {"missing_audio": 1}
    with pytest.raises(ConfigError, match=r"^data.hf.columns.audio='audio', but model=llama_tiny has no audio tower"):
        check_hf(compose_cfg("model=llama_tiny", "data=hf", f"data.path={tmp_path}", "data.hf.columns.audio=audio"))


def test_a_blend_of_hf_sources_resumes_exactly_and_checks_each_source(tmp_path, compose_cfg):
    """data.blend over data=hf files: each source a seeded row stream of its own, mixed at its weight, a position
    replaying the rest exactly across the small source's epochs; a source without the mapped column is one line,
    and data.path is not needed."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write(tmp_path / "a", "parquet", [{"text": f"alpha {i}"} for i in range(30)])
    b = write(tmp_path / "b", "jsonl.gz", [{"text": f"beta {i}"} for i in range(6)])
    blend = f"data.blend=[{{path:{a},weight:0.75,name:a}},{{path:{b},weight:0.25,name:b}}]"
    cfg = compose_cfg("model=llama_tiny", "data=hf", blend, f"data.hf.cache_dir={tmp_path / 'cache'}")
    check_hf(cfg)
    stream = open_stream(cfg.data, seed=3)
    assert isinstance(stream, BlendedStream)
    whole = [(e.position, e.item.key) for e in itertools.islice(stream.elements(), 60)]
    assert abs(sum(key.startswith("b:") for _, key in whole) - 15) <= 1  # 0.25 of 60: b's 6 rows read 2.5 times
    for start in (7, 25, 41):
        again = [(e.position, e.item.key) for e in itertools.islice(stream.elements(whole[start][0]), 60 - start)]
        assert again == whole[start:], start
    (tmp_path / "c").mkdir()
    c = write(tmp_path / "c", "parquet", [{"caption": "gamma"}])
    with pytest.raises(ConfigError) as error:
        check_hf(compose_cfg("model=llama_tiny", "data=hf", f"data.blend=[{{path:{a}}},{{path:{c}}}]"))
    assert str(error.value) == f"data.hf.columns.text='text': {c} has no such column; its columns are ['caption']"
    validate_run(typed_config(compose(["model=llama_tiny", "data=hf", blend, "trainer.accelerator=cpu"])))
