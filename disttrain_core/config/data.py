"""The data config group's schema (``data.*``): shards, tokenizer, the synthetic generator, blends, the held-out
split, the data producer and packing (re-exported by config/schema.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


# ---------------------------------------------------------------------------- data
@dataclass
class SyntheticDataConfig:
    """Parameters of the embedded LAION-like generator (docs/DATA.md)."""

    num_shards: int = 8
    samples_per_shard: int = 512
    val_shards: int = 1  # the held-out split beside the data (data.val.path: <data.path>_val), generated on use
    seed: int = 1234
    text_only_fraction: float = 0.05
    images_geometric_p: float = 0.45  # P(k images) ~ Geometric(p) on k >= 1, truncated
    max_images: int = 8
    caption_words_log_mean: float = 2.1  # log-normal words per text segment
    caption_words_log_sigma: float = 0.6
    image_side_log_mean: float = 5.3  # log-normal shorter side in pixels (e^5.3 ~ 200 px)
    image_side_log_sigma: float = 0.45
    image_side_max: int = 512
    aspect_log_sigma: float = 0.25
    # A share of the images drawn as short videos instead (animated WebP, the shape sliding across its frames), with
    # a frame count uniform on 2..video_frames_max; 0 keeps the default shards free of video
    video_fraction: float = 0.0
    video_frames_max: int = 16
    # A share of the samples given one audio clip too (FLAC, 16 kHz mono: a tone the caption before it names, its
    # pitch and its glide), 0.5-2 s long; 0 keeps the default shards free of audio
    audio_fraction: float = 0.0


@dataclass
class ReorderConfig:
    intra: bool = True  # Algorithm 2: balance DP groups inside each global batch
    inter: bool = True  # Algorithm 3: order microbatches against 1F1B bubbles


@dataclass
class ProducerConfig:
    """Disaggregated preprocessing (docs/DATA.md): decode, tokenize and reorder off the trainers."""

    workers: int = 0  # decode processes of each producer train.py starts (0: decode in the trainers)
    # Producers train.py starts (a pool: each serves a fixed share of the data-parallel groups and decodes only
    # its share; the batches do not depend on the count). At most the number of data-parallel groups.
    count: int = 1
    restarts: int = 3  # a local producer that dies is started again on its address, at most this many times each
    # HOST:PORT of a standalone producer (python -m disttrain_core.launch.producer), or a pool's list in pool order:
    # data.producer.address=[HOST1:PORT1,HOST2:PORT2] (a string or a list of strings)
    address: Any = None
    listen: str = "127.0.0.1:0"  # where the producer train.py starts listens (port 0: any free port)
    # Shared key; null: train.py makes one for the producer it starts (never written to disk).
    # Standalone: hex:<64 hex digits>, file:<path>, or the environment variable DISTTRAIN_PRODUCER_KEY.
    key: Optional[str] = None
    timeout_s: float = 120.0  # a producer that does not answer within this fails the run with a clear error
    max_frame_mb: int = 1024
    prefetch_steps: int = 2  # global batches prepared ahead
    max_connections: int = 256  # the producer closes connections beyond this many at once
    handshake_timeout_s: float = 10.0  # the producer drops a connection that has not authenticated by then
    # true: each trainer receives only its unit replica's samples of every slot, and a per-sample summary of
    # the rest (image counts, loss tokens, generation weights); false: every trainer the whole global batch
    per_rank: bool = True
    reorder: ReorderConfig = field(default_factory=ReorderConfig)


@dataclass
class PackingConfig:
    """Variable-length text packed into rows with document masks (data/packing.py, docs/HOTSPA.md)."""

    enabled: bool = False
    # commoncrawl | github: synthetic documents with those long-tail length profiles (deterministic per step);
    # corpus: the documents of data.packing.corpus (data/corpus.py)
    source: str = "commoncrawl"
    # source=corpus: a .jsonl file or a directory of them ("text" per line), or webdataset shards (a directory,
    # file, glob or brace pattern; a sample's .txt, or its .json "text" / "texts")
    corpus: Optional[str] = None
    documents_per_step: int = 64  # the global batch, in documents
    # Every length of the profile times this (its shape kept): 1/32 draws the seed's 32K-context corpus for a
    # 1K-context model. Lengths are then clamped to the last bucket.
    length_scale: float = 1.0
    # Ascending length boundaries: bucket k packs the documents of length in (buckets[k-1], buckets[k]] into
    # rows of buckets[k] tokens; None: one bucket of model.seq_len. The last is the longest document drawn.
    buckets: Optional[list[int]] = None
    rows_per_microbatch: int = 1  # packed rows per microbatch on one rank (HotSPa: 1)
    # A token budget per microbatch instead: a bucket of c-token rows runs max(1, tokens_per_microbatch // c)
    # rows per microbatch on one rank, so short buckets do not pay per-microbatch costs (TP/CP collectives,
    # pipeline hops) once per short row. None: rows_per_microbatch for every bucket.
    tokens_per_microbatch: Optional[int] = None


@dataclass
class BlendSourceConfig:
    """One source of a blend (data.blend, data/blend.py)."""

    path: str = MISSING  # shards, as data.path takes them
    weight: float = 1.0  # relative; the weights are normalized over the sources
    name: Optional[str] = None  # in keys and logs (default: source<index>)


@dataclass
class ValDataConfig:
    """The held-out split (data/splits.py): shards an evaluation reads and training never does."""

    path: Optional[str] = None  # shards of their own, as data.path takes them
    holdout_shards: int = 0  # or: hold out the last N of data.path's shards (sorted order)


@dataclass
class HFDataConfig:
    """data.format=hf (data/hf_source.py): rows of parquet, arrow or jsonl(.gz) files, read with HF datasets."""

    # Which column holds what: text (a string), image and audio (bytes, a {bytes, path} struct or a file path),
    # conversations (LLaVA's list of turns, or its JSON string). null: not read. At least text or conversations.
    columns: dict[str, Optional[str]] = field(
        default_factory=lambda: {"text": "text", "image": None, "audio": None, "conversations": None}
    )
    streaming: bool = False  # true: an IterableDataset (rows read as they come); false: the mapped (cached) dataset
    shuffle_buffer: int = 1000  # streaming: rows of datasets' shuffle buffer (files are shuffled too)
    cache_dir: Optional[str] = None  # the mapped dataset's arrow cache (null: datasets' default, HF_DATASETS_CACHE)
    image_root: Optional[str] = None  # where relative image paths start (null: the directory of data.path)


@dataclass
class DataConfig:
    name: str = MISSING
    path: str = MISSING  # directory of .tar shards, or a brace pattern like dir/shard-{000..099}.tar
    # webdataset: samples from .tar shards (images and text); tokens: a .npy file of pre-tokenized text
    # (data/token_file.py; text-only models); hf: rows of parquet / arrow / jsonl files (data.hf, data/hf_source.py)
    format: str = "webdataset"
    tokenizer: str = "byte"  # or a tokenizer.json / tiktoken file, its format read from it (docs/DATA.md)
    chat_template: str = "auto"  # conversations (data/conversations.py): auto | vicuna | chatml | llama3 | a .jinja
    num_workers: int = 1  # decode workers per training process (0 = decode inline)
    prefetch_steps: int = 2  # optimizer steps of decoded samples kept ready ahead of the trainer
    # Niceness added to decode workers so they do not preempt the training threads (stalled at OpenMP barriers)
    worker_nice: int = 10
    shuffle_shards: bool = True  # reshuffle shard order every epoch (seeded)
    # No shards at data.path: generate the embedded synthetic ones there, but only if data.path is the data
    # group's own location (paths.data_dir/<data.name>) or an existing empty directory (a typo is an error).
    generate_if_missing: bool = False
    allow_missing_shards: bool = False  # true: train on the shards a pattern names that exist (warned), else an error
    # fsspec options per protocol for shards behind URLs (data/storage.py, docs/DATA.md), e.g.
    # 'data.storage_options={s3:{endpoint_url:"http://127.0.0.1:9000"}}' or {s3:{anon:true}}. Never credentials
    # (the config is saved with the run; they come from the environment). Any: a {} default refuses override keys.
    storage_options: Any = None
    max_image_pixels: int = 64_000_000  # larger images are skipped and counted
    # Frames a video member (an animated webp, gif or apng) gives the image encoder, at most: spread evenly from its
    # first to its last frame; each frame is an image of the row (its patches in the sequence, its encoder work)
    video_frames: int = 8
    # Several shard sources mixed at fixed weights (data/blend.py); set, it replaces data.path, e.g.
    # 'data.blend=[{path:/data/laion,weight:0.7},{path:/data/mmc4,weight:0.3}]'
    blend: Optional[list[BlendSourceConfig]] = None
    val: ValDataConfig = field(default_factory=ValDataConfig)
    hf: HFDataConfig = field(default_factory=HFDataConfig)
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    producer: ProducerConfig = field(default_factory=ProducerConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
