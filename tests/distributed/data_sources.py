"""The data sources the trainer reads, as overrides for ``train.py`` (tests/distributed/conftest.py makes the
files once per session): image-text and text-only webdataset shards, a pre-tokenized ``.npy`` file, packed
synthetic long-tail text, and packed text from a webdataset corpus.

``equal_tokens=True`` picks the variant in which every data-parallel replica reads the same number of loss
tokens every step (what local SGD's identity with synchronous SGD assumes): captions longer than the
sequence, full windows, packed documents that each fill a row exactly.
"""

from __future__ import annotations

import tarfile
from io import BytesIO
from pathlib import Path

import numpy as np

SOURCES = ("shards", "image_shards", "tokens", "packed", "corpus")
SEQ_LEN = 64  # every source's sequence length (the packed sources' last bucket)
TEXT_SOURCES = ("shards", "tokens", "packed", "corpus")  # those a text-only model reads


def make_sources(root: Path, image_shards: Path) -> dict[str, Path]:
    """The files behind the sources: ``image_shards`` is the session's mllm shards (tests/conftest.py)."""
    from disttrain_core.config import SyntheticDataConfig
    from disttrain_core.data.synthetic import generate_shards

    text = root / "text_shards"  # captions of ~30 words, all longer than SEQ_LEN bytes
    generate_shards(
        SyntheticDataConfig(
            num_shards=4,
            samples_per_shard=16,
            text_only_fraction=1.0,
            caption_words_log_mean=3.5,
            caption_words_log_sigma=0.05,
        ),
        text,
        processes=1,
    )
    tokens = root / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 384, 40_000).astype(np.uint16))
    exact = root / "exact_corpus"  # documents of SEQ_LEN tokens: <bos> + SEQ_LEN - 2 bytes + <eos>
    exact.mkdir()
    rng = np.random.default_rng(1)
    for shard in range(2):
        with tarfile.open(exact / f"{shard:05d}.tar", "w") as tar:
            for index in range(32):
                document = "".join(chr(c) for c in rng.integers(97, 123, SEQ_LEN - 2)).encode()
                info = tarfile.TarInfo(f"{shard:05d}{index:05d}.txt")
                info.size = len(document)
                tar.addfile(info, BytesIO(document))
    return {"text_shards": text, "image_shards": image_shards, "tokens": tokens, "exact_corpus": exact}


def source_overrides(source: str, paths: dict[str, Path], equal_tokens: bool = False) -> list[str]:
    """``train.py`` overrides that read ``source`` (with the model that reads it)."""
    text = ["model=llama_tiny", f"model.seq_len={SEQ_LEN}"]
    packed = [*text, "data=longtail_text", "data.packing.buckets=[32,64]", "data.packing.documents_per_step=16"]
    if source == "shards":
        return [
            *text,
            f"data.path={paths['text_shards']}",
            "data.generate_if_missing=false",
            "data.shuffle_shards=false",
        ]
    if source == "image_shards":
        return ["model=mllm_tiny", f"data.path={paths['image_shards']}", "data.generate_if_missing=false"]
    if source == "tokens":
        return [*text, "data=tokens", f"data.path={paths['tokens']}"]
    if source == "packed":  # dense: documents of exactly each bucket's length, one per row
        return [*packed, f"data.packing.source={'dense' if equal_tokens else 'commoncrawl'}"]
    if source == "corpus":
        corpus = paths["exact_corpus" if equal_tokens else "text_shards"]
        return [*packed, "data.packing.source=corpus", f"data.packing.corpus={corpus}"]
    raise ValueError(f"unknown data source {source!r}: one of {', '.join(SOURCES)}")


def small_text_run(steps: int) -> list[str]:
    """A 2-layer, 64-wide Llama; 8 sequences a step in microbatches of 2; fp32 on CPU; a log line a step."""
    return [
        "model.llm.dim=64",
        "model.llm.ffn_dim=128",
        "model.llm.n_layers=2",
        "optim.global_batch_size=8",
        "optim.micro_batch_size=2",
        f"trainer.max_steps={steps}",
        "trainer.precision=32",
        "trainer.accelerator=cpu",
        "trainer.progress_bar=false",
        "trainer.log_every_n_steps=1",
        "data.num_workers=0",
    ]
