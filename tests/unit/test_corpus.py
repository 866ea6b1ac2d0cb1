"""Packed text from a corpus on disk (data.packing.source=corpus): JSON lines and webdataset shards become
[bos] + tokens + [eos] documents in a fixed order, long ones are cut at the last bucket, bad records are
skipped and counted, and a resumed loader reads exactly the documents the uninterrupted one reads."""

import json

import pytest
import torch

from disttrain_core.config import compose, typed_config
from disttrain_core.data.corpus import CorpusDocuments
from disttrain_core.data.packed_loader import PackedStepLoader
from disttrain_core.data.tokenizer import ByteTokenizer
from disttrain_core.planner.fit import validate_run
from disttrain_core.validation import ConfigError

from ..conftest import write_tar

TOK = ByteTokenizer()


def _jsonl(tmp_path, lines):
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _ids(text):
    return [TOK.bos_id, *text.encode(), TOK.eos_id]


def test_jsonl_documents_in_order_cut_and_counted(tmp_path):
    texts = ["ab", "x" * 20, "hello", "q"]
    lines = [json.dumps({"text": texts[0]}), "{not json", json.dumps({"text": texts[1]}), json.dumps({"id": 3})]
    lines += [json.dumps({"text": texts[2]}), json.dumps({"text": texts[3]})]
    corpus = CorpusDocuments(_jsonl(tmp_path, lines), TOK, max_len=8)
    step0 = [d.tolist() for d in corpus.documents(0, 3)]  # records 0-2: one bad, one cut into 8 + 8 + 6
    long = _ids(texts[1])
    assert step0 == [_ids("ab"), long[:8], long[8:16], long[16:]]
    assert corpus.split == 2 and corpus.skipped == {"corpus_bad_json": 1}
    step1 = [d.tolist() for d in corpus.documents(1, 3)]  # records 3-5: one without text
    assert step1 == [_ids("hello"), _ids("q")] and corpus.skipped["corpus_no_text"] == 1
    step2 = [d.tolist() for d in corpus.documents(2, 3)]  # the next epoch starts over
    assert step2 == step0
    fresh = CorpusDocuments(_jsonl(tmp_path, lines), TOK, max_len=8)
    assert [d.tolist() for d in fresh.documents(2, 3)] == step0  # resumed at step 2: the same documents
    # its own bad record counts; the bad records of steps 0-1 it passed over while seeking do not
    assert fresh.skipped == {"corpus_bad_json": 1}


def test_webdataset_samples_become_documents(tmp_path):
    write_tar(
        tmp_path / "shard-0.tar",
        [
            ("a", {"json": json.dumps({"texts": ["a red square", None, "on blue"]}).encode(), "0.jpg": b"\xff"}),
            ("b", {"txt": b"plain text"}),
            ("c", {"json": b"\x00broken"}),
        ],
    )
    corpus = CorpusDocuments(str(tmp_path), TOK, max_len=64)
    docs = [d.tolist() for d in corpus.documents(0, 3)]
    assert docs == [_ids("a red square on blue"), _ids("plain text")]
    assert corpus.skipped == {"corpus_bad_json": 1}


def test_packed_steps_of_a_corpus_resume_exactly(tmp_path):
    lines = [json.dumps({"text": "w" * n}) for n in (3, 30, 7, 12, 50, 5, 9, 2, 40, 6)] + ["bad"]
    path = _jsonl(tmp_path, lines)

    def loader(state=None):
        corpus = CorpusDocuments(path, TOK, max_len=32)
        return PackedStepLoader("corpus", 4, [8, 32], 384, 0, state, corpus=corpus)

    first = loader()
    steps = [first.next_step() for _ in range(4)]
    state = {"step": 2, "skipped": {}}
    resumed = loader(state)
    for want in steps[2:]:
        got = resumed.next_step()
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.doc_ids, b.doc_ids)
    assert first.state_dict() == {"step": 4, "skipped": {"corpus_bad_json": 1}}
    assert resumed.state_dict()["skipped"] == {"corpus_bad_json": 1}


def test_a_corpus_source_needs_a_readable_path(tmp_path):
    base = ["model=llama_tiny", "data=longtail_text", "data.packing.source=corpus"]
    with pytest.raises(ConfigError, match="data.packing.source=corpus reads data.packing.corpus"):
        validate_run(typed_config(compose(base)))
    with pytest.raises(ConfigError, match="names no webdataset shard"):
        validate_run(typed_config(compose([*base, f"data.packing.corpus={tmp_path}/none"])))
    validate_run(typed_config(compose([*base, f"data.packing.corpus={_jsonl(tmp_path, ['{}'])}"])))


def test_parquet_arrow_and_c4_json_gz_rows_are_documents(tmp_path):
    """Tables (parquet, arrow) and C4's .json.gz lines, named by a brace pattern, read in order: one document
    per row from its text column (data=hf: the column data.hf.columns names), a row without text counted."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": "first", "url": "a"}, {"text": None, "url": "b"}, {"text": "third", "url": "c"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    table = pa.Table.from_pylist([{"caption": "a red square", "text": "not this"}])
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    for i in range(2):
        with gzip.open(tmp_path / f"c4-train.{i:05d}-of-01024.json.gz", "wt") as out:
            out.write(json.dumps({"text": f"c4 document {i}", "timestamp": "2019", "url": "x"}) + "\n")

    parquet = CorpusDocuments(str(tmp_path / "c.parquet"), TOK, max_len=64)
    assert (parquet.kind, [d.tolist() for d in parquet.documents(0, 3)]) == ("table", [_ids("first"), _ids("third")])
    assert parquet.skipped == {"corpus_no_text": 1}
    mapped = CorpusDocuments(str(tmp_path / "d.arrow"), TOK, 64, columns={"text": "caption", "conversations": None})
    assert [d.tolist() for d in mapped.documents(0, 1)] == [_ids("a red square")]
    c4 = CorpusDocuments(f"{tmp_path}/c4-train.{{00000..00001}}-of-01024.json.gz", TOK, max_len=64)
    assert (c4.kind, [d.tolist() for d in c4.documents(0, 2)]) == ("jsonl", [_ids(f"c4 document {i}") for i in (0, 1)])
    remote = CorpusDocuments(f"file://{tmp_path}/c4-train.00001-of-01024.json.gz", TOK, max_len=64)  # a URL
    assert [d.tolist() for d in remote.documents(0, 1)] == [_ids("c4 document 1")]


def test_data_hf_packs_the_rows_of_data_path(tmp_path):
    """data=hf with data.packing.enabled packs data.path's rows (data.packing.source=corpus, no corpus path); the
    synthetic sources are refused in one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from disttrain_core.data.packed_loader import packed_loader

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"caption": [f"row {i} " * (i + 1) for i in range(12)]}), path)
    base = ["model=llama_tiny", "data=hf", f"data.path={path}", "data.hf.columns.text=caption"]
    base += ["data.packing.enabled=true", "data.packing.documents_per_step=4"]
    with pytest.raises(ConfigError) as error:
        validate_run(typed_config(compose(base)))
    assert str(error.value) == (
        "data.packing.source='commoncrawl' draws synthetic documents; data=hf packs the rows of data.path: set "
        "data.packing.source=corpus"
    )
    cfg = typed_config(compose([*base, "data.packing.source=corpus"]))
    validate_run(cfg)
    loader = packed_loader(cfg, None)
    loader.next_step()
    assert loader.corpus.kind == "table" and loader.state_dict() == {"step": 1, "skipped": {}}
    assert [d.tolist() for d in loader.corpus.documents(1, 4)] == [_ids(f"row {i} " * (i + 1)) for i in range(4, 8)]
