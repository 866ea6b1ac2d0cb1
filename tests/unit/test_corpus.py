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
