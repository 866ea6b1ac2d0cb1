"""Train a small byte-level BPE tokenizer on the texts of webdataset shards (docs/DATA.md).

    python tools/train_tokenizer.py                                  # embedded data -> data/tokenizer
    python tools/train_tokenizer.py out=/tmp/tok vocab_size=1024 "data.path='/datasets/laion/{00000..00099}.tar'"
    python train.py data.tokenizer=data/tokenizer/tokenizer.json model.llm.vocab_size=512

Reads the shards named by ``data.path`` with the trainer's own reader and sample parser (captions and
interleaved texts; images are skipped) and writes ``tokenizer.json`` and ``tokenizer_config.json`` into
``out``. Special tokens: <pad> <bos> <eos> <image> <gen> (ids 0-4). ``max_samples=N`` reads only the first N
samples (0: all). Prints the vocabulary size to give as ``model.llm.vocab_size``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from disttrain_core.config import compose
from disttrain_core.data.reader import RawSample, ShardStream, resolve_shards
from disttrain_core.data.samples import BadSample, parse_segments
from disttrain_core.launch.cli import split_tool_args, tool_main
from disttrain_core.validation import ConfigError

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<image>", "<gen>"]


def shard_texts(shards: list[str], max_samples: int, counts: dict[str, int]) -> Iterator[str]:
    """Every text segment of the shards' samples, in shard order; unusable samples are counted and skipped."""
    stream = ShardStream(shards, 0, 1, seed=0, shuffle=False)
    for element in stream.epoch_elements(0):
        if max_samples and counts["samples"] >= max_samples:
            return
        if not isinstance(element.item, RawSample):
            counts["skipped"] += 1
            continue
        try:
            segments = parse_segments(element.item.members)
        except BadSample:
            counts["skipped"] += 1
            continue
        counts["samples"] += 1
        for kind, value in segments:
            if kind == "text":
                counts["texts"] += 1
                yield str(value)


def train_bpe(texts: Iterator[str], vocab_size: int, min_frequency: int = 2):
    """A byte-level BPE (every byte is in the alphabet, so any text encodes) with SPECIAL_TOKENS first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def main(argv: list[str]) -> int:
    options, overrides = split_tool_args(
        argv, {"out": "", "vocab_size": "512", "min_frequency": "2", "max_samples": "0"}
    )
    cfg = compose(overrides)
    out = Path(options["out"] or Path(cfg.paths.data_dir) / "tokenizer")
    try:
        vocab_size, min_frequency, max_samples = (
            int(options[k]) for k in ("vocab_size", "min_frequency", "max_samples")
        )
    except ValueError:
        raise ConfigError("vocab_size, min_frequency and max_samples take whole numbers, e.g. vocab_size=512") from None
    smallest = 256 + len(SPECIAL_TOKENS)
    if vocab_size < smallest:
        raise ConfigError(f"vocab_size={vocab_size}: a byte-level BPE needs at least {smallest} (256 bytes + specials)")
    shards = resolve_shards(cfg.data.path)
    if not shards:
        raise ConfigError(
            f"data.path={cfg.data.path!r}: no .tar shards found; point data.path at webdataset shards, or run "
            "`python tools/make_shards.py` to create the embedded data"
        )
    started = time.perf_counter()
    counts = {"samples": 0, "texts": 0, "skipped": 0}
    tokenizer = train_bpe(shard_texts(shards, max_samples, counts), vocab_size, min_frequency)
    if counts["texts"] == 0:
        raise ConfigError(f"data.path={cfg.data.path!r}: the shards hold no text to train a tokenizer on")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    note = "" if size == vocab_size else f" (asked for {vocab_size}: the texts offer no more merges)"
    print(
        f"trained a byte-level BPE on {counts['texts']} texts of {counts['samples']} samples from {len(shards)} "
        f"shards in {time.perf_counter() - started:.1f}s (skipped {counts['skipped']})"
    )
    print(f"vocab size {size}{note}")
    print(f"wrote {out / 'tokenizer.json'} and {out / 'tokenizer_config.json'}")
    print(f"use: data.tokenizer={out / 'tokenizer.json'} model.llm.vocab_size={size}")
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
