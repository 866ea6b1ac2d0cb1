"""Llama 3's tokenizer format (a tiktoken BPE file) beside tokenizer.json: one vocabulary, trained here on the
shipped corpus (tests/data/scripts_corpus.txt) and written in both formats, gives the same ids through both loaders.

No real Llama 3 file is downloaded: the tokenizer.json is a byte-level BPE trained with Llama 3's pre-tokenizer
regex (no normalizer), saved with Llama 3's pre-tokenizer, decoder and 256 special tokens, and the tiktoken file
holds the same tokens with each token's id as its rank. The trainer numbers merged tokens in merge order, so
tiktoken's lowest-rank-first merging follows the trained merges.
"""

from __future__ import annotations

import base64
import json
import pickle
import re
import sys
import unicodedata
from collections import Counter

import pytest

from disttrain_core.data.producer_protocol import tokenizer_identity
from disttrain_core.data.tiktoken_bpe import LLAMA3_PATTERN, TiktokenTokenizer, llama3_special_tokens
from disttrain_core.data.tokenizer import HFTokenizer, build_tokenizer
from disttrain_core.launch.cli import PreflightError, check_overrides

from ..conftest import REPO, base_overrides, cli_overrides, read_metrics, run_train

CORPUS = (REPO / "tests/data/scripts_corpus.txt").read_text(encoding="utf-8")
# What a file of lines cannot hold, and text that only looks like a special token.
EXTRA = [
    "",
    "line one\r\nline two\r\n\r\n",
    "\t\ttabs\t and   runs   ",
    "   ",
    "trailing newline\n",
    "<|begin_of_text|><|eot_id|><|reserved_special_token_250|><image><gen><audio><video>",
    "e\u0301 combining, \u200bzero width, \ufeffBOM, NUL\x00 byte",
]


def sections() -> dict[str, str]:
    """The corpus's parts by script, from its ``### <name>`` lines."""
    parts = CORPUS.split("### ")[1:]
    return {part.split("\n", 1)[0]: part.split("\n", 1)[1] for part in parts}


def byte_alphabet() -> dict[int, str]:
    """The character ByteLevel writes for each byte: printable Latin-1 bytes stand for themselves, every other
    byte for the next character from U+0100 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(0x100, 0x200))
    return {value: chr(value if value in printable else next(others)) for value in range(256)}


def train_llama3_style(vocab_size: int):
    """A byte-level BPE on the corpus with Llama 3's pre-tokenizer (its regex, then bytes; no normalizer)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def write_both(out, ignore_merges: bool):
    """(tokenizer.json, tokenizer.model, number of ranks) of one vocabulary, written into ``out``.
    ``ignore_merges``: the tokenizer.json takes a piece that is a whole token as it is, as Llama 3's does (and
    tiktoken always does)."""
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers

    trained = train_llama3_style(vocab_size=3000)
    saved = json.loads(trained.to_str())
    saved["model"]["ignore_merges"] = ignore_merges
    tokenizer = Tokenizer.from_str(json.dumps(saved))
    count = tokenizer.get_vocab_size()
    special = llama3_special_tokens(count)
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in special])
    assert all(tokenizer.token_to_id(name) == i for name, i in special.items())
    tokenizer.save(str(out / "tokenizer.json"))

    to_byte = {char: value for value, char in byte_alphabet().items()}
    assert set(to_byte) == set(pre_tokenizers.ByteLevel.alphabet())
    ranks = {bytes(to_byte[char] for char in token): i for token, i in trained.get_vocab().items()}
    assert sorted(ranks.values()) == list(range(count)) and len(ranks) == count
    # Ranks in merge order: merge k makes the token of rank 256 + k, so the lower rank is the earlier merge.
    merges = [m if isinstance(m, list) else m.split(" ") for m in saved["model"]["merges"]]
    assert len(merges) == count - 256 > 1000
    assert all(ranks[bytes(to_byte[c] for c in a + b)] == 256 + k for k, (a, b) in enumerate(merges))
    lines = (
        f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda t: t[1])
    )
    (out / "tokenizer.model").write_text("".join(lines))
    return out / "tokenizer.json", out / "tokenizer.model", count


@pytest.fixture(scope="module", params=[False, True], ids=["merges", "ignore_merges"])
def files(request, tmp_path_factory):
    return write_both(tmp_path_factory.mktemp("llama3_style"), request.param)


def test_the_corpus_covers_eight_scripts_in_over_10000_characters():
    assert len(CORPUS) >= 10_000, len(CORPUS)
    letters = Counter(unicodedata.name(c).split()[0] for c in CORPUS if c.isalpha())
    scripts = {"LATIN", "CYRILLIC", "GREEK", "ARABIC", "DEVANAGARI", "CJK", "HANGUL", "HIRAGANA"}
    assert all(letters[script] >= 40 for script in scripts), letters
    assert set(sections()) == {"latin", "cyrillic", "greek", "arabic", "devanagari", "cjk", "hangul", "mixed"}
    mixed = sections()["mixed"]
    assert "    " in mixed and "\t\t" in mixed and "\n\n\n" in mixed and "👨‍👩‍👧‍👦" in mixed and "1234567890" in mixed


def test_llama3_pattern_and_special_tokens():
    import regex

    pieces = regex.findall(LLAMA3_PATTERN, "I'LL pay 12345 now!!\n\n  ok")
    assert pieces == ["I", "'LL", " pay", " ", "123", "45", " now", "!!\n\n", " ", " ok"]
    special = llama3_special_tokens(128000)
    assert len(special) == 256 and sorted(special.values()) == list(range(128000, 128256))
    assert [special[n] for n in ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>")] == [
        128000,
        128001,
        128006,
    ]
    assert [special[n] for n in ("<|end_header_id|>", "<|eot_id|>")] == [128007, 128009]
    reserved = [special[f"<|reserved_special_token_{i}|>"] for i in (0, 1, 2, 3, 4, 5, 250)]
    assert reserved == [128002, 128003, 128004, 128005, 128008, 128010, 128255]


def test_both_formats_give_the_same_ids(files):
    json_file, tiktoken_file, count = files
    hf, tk = build_tokenizer(str(json_file)), build_tokenizer(str(tiktoken_file))
    assert isinstance(hf, HFTokenizer) and isinstance(tk, TiktokenTokenizer)
    texts = {"corpus": CORPUS, **sections(), **{f"extra{i}": text for i, text in enumerate(EXTRA)}}
    for name, text in texts.items():
        ids = tk.encode(text)
        assert hf.encode(text) == ids, name
        assert all(i < count for i in ids), name  # text never becomes a special token
        assert hf.decode(ids) == tk.decode(ids) == text, name
    ids = tk.encode(CORPUS)
    assert len(ids) < len(CORPUS.encode()) / 2.5 and sum(i >= 256 for i in ids) > 0.7 * len(ids)  # merges used


def test_special_ids_and_vocabulary_are_the_same(files):
    json_file, tiktoken_file, count = files
    hf, tk = HFTokenizer(json_file, audio=True, video=True), TiktokenTokenizer(tiktoken_file, audio=True, video=True)
    expected = (count + 256 + 4, count, count + 1, count + 1, count + 256, count + 257, count + 258, count + 259)
    for tokenizer in (hf, tk):
        fields = ("vocab_size", "bos_id", "eos_id", "pad_id", "image_id", "gen_id", "audio_id", "video_id")
        assert tuple(getattr(tokenizer, field) for field in fields) == expected, tokenizer
        assert tokenizer.added == ["<image>", "<gen>", "<audio>", "<video>"]
    for name in [*llama3_special_tokens(count), "<image>", "<gen>", "<audio>", "<video>"]:
        assert hf.token_to_id(name) == tk.token_to_id(name) is not None, name
    text = "Паром, πλοίο 🙂"
    special = [count + offset for offset in range(260)]
    assert hf.decode([*special, *tk.encode(text), count]) == tk.decode([*special, *tk.encode(text), count]) == text


def test_cut_characters_decode_alike(files):
    """Every prefix of a line's ids, many ending inside a character: both write the same replacement marks."""
    json_file, tiktoken_file, _ = files
    hf, tk = HFTokenizer(json_file), TiktokenTokenizer(tiktoken_file)
    ids = tk.encode("All at once: паром, πλοίο, العبّارة, नौका, 渡船, 배 🙂 👨‍👩‍👧‍👦 🇬🇷")
    decoded = [(hf.decode(ids[:k]), tk.decode(ids[:k])) for k in range(len(ids) + 1)]
    assert all(a == b for a, b in decoded) and sum("\ufffd" in b for _, b in decoded) > 0


def test_a_directory_and_pickling(files, tmp_path):
    _, tiktoken_file, count = files
    (tmp_path / "tokenizer.model").write_bytes(tiktoken_file.read_bytes())
    tok = build_tokenizer(str(tmp_path))  # a directory without tokenizer.json: its tokenizer.model
    assert isinstance(tok, TiktokenTokenizer) and tok.vocab_size == count + 258
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.path == tok.path and clone.encode(CORPUS) == tok.encode(CORPUS)
    # The producer and the trainers compare the file by its content, not its path.
    assert tokenizer_identity(str(tmp_path)) == tokenizer_identity(str(tiktoken_file))
    assert tokenizer_identity(str(tmp_path)).startswith("tokenizer.model#sha256:")


def test_ranks_out_of_merge_order_split_the_text_otherwise(files, tmp_path):
    """The control: the same tokens ranked by length, not by merge, give tiktoken other pieces than the merges."""
    json_file, tiktoken_file, count = files
    tokens = [base64.b64decode(line.split()[0]) for line in tiktoken_file.read_text().splitlines()]
    reordered = tokens[:256] + sorted(tokens[256:], key=lambda t: (len(t), t))
    (tmp_path / "tokenizer.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(reordered))
    )
    other = TiktokenTokenizer(tmp_path / "tokenizer.model")
    assert other.vocab_size == count + 258 and other.decode(other.encode(CORPUS)) == CORPUS
    assert len(other.encode(CORPUS)) != len(HFTokenizer(json_file).encode(CORPUS))


def byte_lines() -> str:
    """A valid tiktoken file of the 256 single bytes."""
    return "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))


@pytest.mark.parametrize(
    "content",
    [b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00", b"hello 1 2\nworld\n", b"", b"[1, 2]", b"   \n\n"],
    ids=["sentencepiece", "words", "empty", "json_list", "blank"],
)
def test_an_unknown_format_is_refused_in_one_line(tmp_path, content):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        build_tokenizer(str(path))
    message = str(info.value)
    assert message.startswith(
        f"data.tokenizer={path}: {path} is neither a Hugging Face tokenizer.json (a JSON object) nor a tiktoken BPE "
        "file (lines of '<base64 token> <rank>')"
    ), message
    assert "\n" not in message


@pytest.mark.parametrize(
    "content, error",
    [
        (byte_lines() + "QUI= 256\nnot base64! 257\n", "line 258 is not '<base64 token> <rank>' (b'not base64! 257')"),
        (byte_lines() + "QUI 256\n", "line 257: b'QUI' is not valid base64"),
        (byte_lines() + "QQ== 256\n", "line 257 repeats the token b'A' of rank 65"),
        (byte_lines() + "QUI= 300\n", "has 257 tokens but no rank 256: ranks run from 0 to 256, once each"),
    ],
    ids=["bad_line", "bad_base64", "repeated", "gap"],
)
def test_a_broken_tiktoken_file_names_its_fault(tmp_path, content, error):
    path = tmp_path / "llama.model"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        build_tokenizer(str(path))
    message = str(info.value)
    assert message.startswith(f"data.tokenizer={path}: {path} {error}; fix the file") and "\n" not in message


def test_a_missing_byte_and_a_missing_package(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b - 1}\n" for b in range(1, 256)))
    with pytest.raises(ValueError, match=r"lacks the single byte 0x00 \(1 of 256 absent\): text holding it has no id"):
        build_tokenizer(str(path))
    path.write_text(byte_lines())
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken now raises ImportError
    with pytest.raises(ValueError, match=r"is a tiktoken BPE file, and the tiktoken package is not installed; pip"):
        build_tokenizer(str(path))


def test_preflight_checks_the_format_and_the_vocabulary(files, shards, tmp_path):
    """Before any process starts: an unknown format, then a model too small for the tiktoken file's ids."""
    _, tiktoken_file, count = files
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00")
    argv = base_overrides(shards, tmp_path / "run") + ["model=llama_tiny"]
    with pytest.raises(PreflightError, match=re.escape(f"data.tokenizer={bad}: {bad} is neither a Hugging Face")):
        check_overrides(argv + [f"data.tokenizer={bad}"])
    size = count + 258
    with pytest.raises(PreflightError, match=f"model.llm.vocab_size=300 is smaller than the {size} ids"):
        check_overrides(argv + [f"data.tokenizer={tiktoken_file}", "model.llm.vocab_size=300"])
    check_overrides(argv + [f"data.tokenizer={tiktoken_file}", f"model.llm.vocab_size={size}"])


def test_training_reads_the_same_rows_through_either_file(shards, tmp_path):
    """Two short runs with decode workers (the tokenizer crosses to them pickled): the same losses."""
    json_file, tiktoken_file, count = write_both(tmp_path, ignore_merges=True)
    losses = []
    for name, file in (("json", json_file), ("tiktoken", tiktoken_file)):
        run_dir = tmp_path / name
        overrides = cli_overrides(shards, run_dir) + ["model=llama_tiny", f"data.tokenizer={file}"]
        overrides += [f"model.llm.vocab_size={count + 258}", "model.seq_len=128", "data.num_workers=1"]
        overrides += ["trainer.max_steps=4", "trainer.checkpoint.every_n_steps=0", "optim.warmup_steps=1"]
        result = run_train(overrides + ["optim.global_batch_size=8", "optim.micro_batch_size=8"], timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        losses.append([row["loss"] for row in read_metrics(run_dir)])
    assert len(losses[0]) == 4 and losses[0] == losses[1], losses
