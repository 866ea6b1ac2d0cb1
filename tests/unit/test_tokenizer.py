"""A real tokenizer: data.tokenizer=<tokenizer.json> (tools/train_tokenizer.py trains one on the shards)."""

import contextlib
import importlib.util
import io
import json
import pickle
import re

import numpy as np
import pytest

from disttrain_core.config import SyntheticDataConfig
from disttrain_core.data.samples import SampleEncoder
from disttrain_core.data.synthetic import make_sample
from disttrain_core.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer
from disttrain_core.launch.cli import PreflightError, check_overrides

from ..conftest import REPO, base_overrides, cli_overrides, read_metrics, run_train


@pytest.fixture(scope="module")
def trained(shards, tmp_path_factory):
    """(tokenizer.json path, printed vocab size): a BPE trained by the tool (in this process) on the test shards."""
    spec = importlib.util.spec_from_file_location("train_tokenizer", REPO / "tools/train_tokenizer.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path_factory.mktemp("tokenizer")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert tool.main([f"out={out}", "vocab_size=400", f"data.path={shards}"]) == 0
    size = int(re.search(r"vocab size (\d+)", printed.getvalue()).group(1))
    return out / "tokenizer.json", size


def test_the_tool_writes_a_tokenizer_the_trainer_reads(trained):
    path, size = trained
    config = json.loads((path.parent / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<bos>", "<eos>", "<pad>")
    tok = build_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    assert 261 < size <= 400 and tok.vocab_size == size and tok.added == []  # <image> and <gen> are trained in
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.image_id, tok.gen_id) == (0, 1, 2, 3, 4)
    assert HFTokenizer(path.parent).vocab_size == size  # the directory works too


def test_round_trip_without_special_ids(trained):
    tok = HFTokenizer(trained[0])
    text = "photo of a red circle on blue, naïve 🙂 <image><gen></s>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges learned from the captions
    # No <bos>/<eos> added (the sample encoder adds them) and text never becomes a placeholder.
    assert not {tok.pad_id, tok.bos_id, tok.eos_id, tok.image_id, tok.gen_id} & set(ids)
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    clone = pickle.loads(pickle.dumps(tok))  # decode workers rebuild it from the path
    assert clone.path == tok.path and clone.encode(text) == ids and clone.vocab_size == tok.vocab_size


def _write_tokenizer(directory, vocab: list[str], config: dict | None = None):
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=vocab[0]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


def test_missing_image_and_gen_tokens_are_added(tmp_path):
    vocab = ["<unk>", "<s>", "</s>", "<eot>", "hello", "world"]
    path = _write_tokenizer(tmp_path / "a", vocab, {"eos_token": {"content": "<eot>", "special": True}})
    tok = HFTokenizer(path)
    assert tok.added == ["<image>", "<gen>"]
    assert (tok.image_id, tok.gen_id, tok.vocab_size) == (6, 7, 8)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 3, 3)  # bos by name, eos from the config, pad -> eos
    assert tok.encode("hello world") == [4, 5] and tok.decode([1, 4, 5, 3]) == "hello world"
    # Without a config: well-known names.
    tok = HFTokenizer(_write_tokenizer(tmp_path / "b", ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<pad>"]))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.image_id, tok.gen_id) == (1, 2, 3, 4, 5)


def test_rows_of_a_real_tokenizer_label_every_text_token(trained, tmp_path):
    from disttrain_core.config import compose

    path = _write_tokenizer(tmp_path / "c", ["<unk>", "</s>", "photo", "of"])  # pad = bos = eos
    tok = HFTokenizer(path)
    assert tok.pad_id == tok.eos_id == tok.bos_id == 1
    model = compose(["model.llm.vocab_size=384"]).model
    for tokenizer in (tok, HFTokenizer(trained[0]), ByteTokenizer()):
        row = SampleEncoder(model, tokenizer, seed=0, max_image_pixels=10**8).encode(
            "k", make_sample(SyntheticDataConfig(), 3)
        )
        end = 1 + int(np.flatnonzero(row.tokens[1:] == tokenizer.eos_id)[0])  # the <eos> (bos may equal it)
        following = np.append(row.tokens[1:], -1)
        placeholder = (following == tokenizer.image_id) | (following == tokenizer.gen_id)
        valid = row.labels != -100
        assert np.array_equal(row.labels[valid], following[valid])
        # Every next text token and the <eos> is predicted; placeholders and everything after <eos> are not.
        assert np.array_equal(valid, (np.arange(len(valid)) < end) & ~placeholder)
        assert valid[end - 1] and row.labels[end - 1] == tokenizer.eos_id
        if tokenizer is not tok:
            text = row.labels[valid & (row.labels != tokenizer.eos_id)]
            assert (text >= 256).any() == isinstance(tokenizer, HFTokenizer)  # BPE merges lie above the bytes


def test_errors_name_the_setting(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    no_eos = _write_tokenizer(tmp_path / "d", ["<unk>", "hello"])
    for value, text in (
        (tmp_path / "none.json", "no such file"),
        (tmp_path / "bad.json", "not a readable tokenizer.json"),
        (no_eos, "no end-of-text token"),
    ):
        with pytest.raises(ValueError) as info:
            build_tokenizer(str(value))
        message = str(info.value)
        assert message.startswith(f"data.tokenizer={value}: {text}") and "\n" not in message, message


def test_validation_refuses_a_vocabulary_larger_than_the_model(trained, shards, tmp_path):
    path, size = trained
    argv = base_overrides(shards, tmp_path / "run") + ["model=llama_tiny", f"data.tokenizer={path}"]
    with pytest.raises(PreflightError) as info:
        check_overrides(argv + ["model.llm.vocab_size=300"])
    message = str(info.value)
    assert f"model.llm.vocab_size=300 is smaller than the {size} ids" in message, message
    assert f"set model.llm.vocab_size={size}" in message
    check_overrides(argv + [f"model.llm.vocab_size={size}"])
    with pytest.raises(PreflightError, match="data.tokenizer=/no/such/tokenizer.json: no such file"):
        check_overrides(argv[:-1] + ["data.tokenizer=/no/such/tokenizer.json"])


def test_llama_trains_with_the_trained_tokenizer(trained, shards, tmp_path):
    path, size = trained
    run_dir = tmp_path / "run"
    result = run_train(
        cli_overrides(shards, run_dir)
        + [
            "model=llama_tiny",
            f"data.tokenizer={path}",
            f"model.llm.vocab_size={size}",
            "model.seq_len=128",
            "trainer.max_steps=6",
            "trainer.checkpoint.every_n_steps=0",
            "optim.warmup_steps=1",
            "optim.global_batch_size=8",
            "optim.micro_batch_size=8",
        ],
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(run_dir)]
    assert len(losses) == 6 and losses[0] > losses[-1], losses
