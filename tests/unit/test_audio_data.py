"""Audio through the data path: a clip member becomes ``<audio>`` placeholders and log-mel features in the data
workers, rides in the Batch and the producer's frames, is counted when it does not fit or has no tower to read
it, and is skipped and counted when it does not decode."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import soundfile
import torch

from disttrain_core.config import compose, typed_config
from disttrain_core.data.batch import concat
from disttrain_core.data.loader import MicrobatchLoader, collate
from disttrain_core.data.producer_protocol import decode_batch, encode_batch
from disttrain_core.data.reader import ShardStream
from disttrain_core.data.samples import BadSample, SampleEncoder
from disttrain_core.data.tokenizer import ByteTokenizer, HFTokenizer, tokenizer_for
from disttrain_core.data.transport import ProtocolError

from ..conftest import write_tar


def clip(seconds: float = 0.5, rate: int = 16000, fmt: str = "FLAC") -> bytes:
    t = np.arange(round(seconds * rate)) / rate
    buffer = io.BytesIO()
    soundfile.write(buffer, (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format=fmt)
    return buffer.getvalue()


def png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (40, 40), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def interleaved(*entries) -> dict[str, bytes]:
    """A sample of texts and members in order: a str is a text, a (name, bytes) pair a member."""
    texts, names, members = [], [], {}
    for entry in entries:
        if isinstance(entry, str):
            texts.append(entry)
            names.append(None)
        else:
            texts.append(None)
            names.append(entry[0])
            members[entry[0]] = entry[1]
    return {"json": json.dumps({"texts": texts, "images": names}).encode(), **members}


def encoder_for(model: str = "any2any_tiny", *extra: str) -> SampleEncoder:
    cfg = typed_config(compose([f"model={model}", *extra]))
    return SampleEncoder(cfg.model, tokenizer_for(cfg), 0, cfg.data.max_image_pixels, cfg.data.video_frames)


def test_a_clip_becomes_placeholders_and_log_mel_features():
    enc = encoder_for()
    sample = enc.encode("k", interleaved("hear this", ("a.flac", clip()), "and see", ("b.png", png()), "done"))
    tok = ByteTokenizer()
    assert (sample.tokens == tok.audio_id).sum() == 50 and (sample.tokens == tok.image_id).sum() == 16
    assert sample.audio.shape == (1, 32, 100) and sample.audio.dtype == np.float32
    assert (sample.labels == tok.audio_id).sum() == 0  # placeholders never take a loss as targets
    first = int(np.argmax(sample.tokens == tok.audio_id))
    assert sample.labels[first - 1] == -100  # nor is a placeholder predicted from the text before it
    assert sample.truncated_audio == 0


def test_a_clip_that_does_not_fit_or_has_no_tower_is_dropped_and_counted():
    long_text = "x" * 210  # of the 250 positions a row leaves (256 - bos, eos, 4 <gen>), 40 for 50 <audio>
    fits_not = encoder_for().encode("k", interleaved(long_text, ("a.wav", clip(fmt="WAV"))))
    assert fits_not.audio.shape[0] == 0 and fits_not.truncated_audio == 1
    no_tower = encoder_for("mllm_tiny").encode("k", interleaved("hear", ("a.flac", clip())))
    assert no_tower.audio.shape[0] == 0 and no_tower.truncated_audio == 1
    assert (no_tower.tokens == ByteTokenizer().audio_id).sum() == 0


def test_a_caption_pair_with_an_audio_member_reads_it():
    sample = encoder_for().encode("k", {"txt": b"a tone", "flac": clip()})
    assert sample.audio.shape == (1, 32, 100)


@pytest.mark.parametrize("data", [b"fLaC" + b"\x00" * 40, b"\xff" * 64])
def test_an_undecodable_clip_is_skipped_and_counted_by_the_loader(tmp_path, data):
    good = interleaved("fine", ("a.flac", clip()))
    bad = interleaved("broken", ("a.flac", data))
    write_tar(tmp_path / "shard-000000.tar", [("000", good), ("001", bad), ("002", good)])
    with pytest.raises(BadSample) as info:
        encoder_for().plan("001", bad)
    assert info.value.reason == "bad_audio"
    stream = ShardStream([str(tmp_path / "shard-000000.tar")], 0, 1, seed=0, shuffle=False)
    loader = MicrobatchLoader(stream, encoder_for(), micro_batch_size=2, microbatches_per_step=1)
    (batch,) = loader.next_step()
    assert [k[-3:] for k in batch.keys] == ["000", "002"] and dict(loader.skipped) == {"bad_audio": 1}
    assert batch.audio.shape == (2, 32, 100) and batch.audio_counts.tolist() == [1, 1]


def test_batches_cut_join_and_cross_the_producer_frame_with_their_clips():
    enc = encoder_for()
    samples = [
        enc.encode("a", interleaved("one", ("a.flac", clip()))),
        enc.encode("b", interleaved("two")),
        enc.encode("c", interleaved("three", ("a.flac", clip(0.3)), "more")),
    ]
    batch = collate(samples)
    assert batch.audio_counts.tolist() == [1, 0, 1] and batch.audio.shape == (2, 32, 100)
    tail = batch.select(range(1, 3))
    assert torch.equal(tail.audio, batch.audio[1:]) and tail.audio_counts.tolist() == [0, 1]
    joined = concat([batch.select(range(0, 1)), batch.select(range(1, 2)), tail.select(range(1, 2))])
    assert torch.equal(joined.audio, batch.audio)
    meta, payload = encode_batch(batch)
    back = decode_batch(meta, payload)
    assert torch.equal(back.audio, batch.audio) and torch.equal(back.audio_counts, batch.audio_counts)
    batch.audio_counts = torch.tensor([1, 1, 1])
    meta, payload = encode_batch(batch)
    with pytest.raises(ProtocolError, match="audio counts do not match its audio"):
        decode_batch(meta, payload)


def test_the_audio_placeholder_joins_a_tokenizer_file_only_for_a_model_with_a_tower(tmp_path):
    """``<audio>`` is added to a tokenizer.json only when the model has an audio tower, so a text or image
    model's vocabulary (the cookbook's 476) does not move."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "</s>": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    backend.save(str(path))
    plain, heard = HFTokenizer(path), HFTokenizer(path, audio=True)
    assert plain.audio_id == -1 and plain.vocab_size == 5  # <image>, <gen> added
    assert heard.audio_id == 5 and heard.vocab_size == 6 and heard.added == ["<image>", "<gen>", "<audio>"]
    assert heard.encode("<audio>") != [heard.audio_id]  # text is text
    import pickle

    assert pickle.loads(pickle.dumps(heard)).audio_id == 5


def test_the_audio_generator_trains_on_each_rows_last_clip():
    """With model.audio_generator the row's last clip is its target (weight 1; zeros and 0 without a clip), with
    seeded noise on its latent grid; the mel latent encoder maps features to that grid; the generation loss sums
    both generators and counts both targets."""
    from disttrain_core.models import build_model, materialize
    from disttrain_core.models.latents import MelLatentEncoder

    enc = encoder_for()
    two = enc.encode("k", interleaved("a", ("a.flac", clip(0.3)), "b", ("b.flac", clip(0.6))))
    none = enc.encode("n", interleaved("no sound"))
    assert two.audio_gen_weight == 1.0 and np.array_equal(two.gen_audio, two.audio[-1])
    assert none.audio_gen_weight == 0.0 and not none.gen_audio.any() and none.gen_audio.shape == (32, 100)
    assert two.audio_gen_noise.shape == (8, 8, 8) and not np.array_equal(two.audio_gen_noise, none.audio_gen_noise)
    again = enc.encode("k", interleaved("a", ("a.flac", clip(0.3)), "b", ("b.flac", clip(0.6))))
    assert np.array_equal(again.audio_gen_noise, two.audio_gen_noise)  # seeded by the sample, not the process
    latents = MelLatentEncoder(8, (8, 8))(torch.from_numpy(two.gen_audio)[None])
    assert latents.shape == (1, 8, 8, 8) and latents.abs().max() > 0
    batch = collate([two, none])
    assert batch.gen_samples() == 0.0 + 1.0  # no image target (neither row has an image), one clip
    cfg = typed_config(compose(["model=any2any_tiny"]))
    model = build_model(cfg.model, tokenizer_for(cfg), device="meta")
    materialize(model, "cpu", seed=0, std=0.02)
    out = model(batch)
    assert float(out["gen_samples"]) == batch.gen_samples()
    out["gen_loss_sum"].backward()
    assert all(p.grad is not None for p in model.audio_generator.parameters())


def test_the_generation_queries_never_see_a_target():
    """<gen> goes before the last image; a clip before it is input only (weight 0), a clip after it the audio
    target; without an image, <gen> goes before the last clip."""
    enc, tok = encoder_for(), ByteTokenizer()
    before = enc.encode("b", interleaved("hear", ("a.flac", clip()), "see", ("i.png", png())))
    after = enc.encode("a", interleaved("see", ("i.png", png()), "hear", ("a.flac", clip())))
    for sample, weight in ((before, 0.0), (after, 1.0)):
        first_gen = int(np.argmax(sample.tokens == tok.gen_id))
        last_audio = int(np.flatnonzero(sample.tokens == tok.audio_id)[-1])
        assert sample.audio_gen_weight == weight and (last_audio > first_gen) == bool(weight)
        assert sample.gen_weight == 1.0 and int(np.flatnonzero(sample.tokens == tok.image_id)[0]) > first_gen


def test_a_trainer_that_reads_no_audio_still_receives_its_shares_counts():
    """A share leaves out the clips of a trainer that does not read them (an encoder unit, a middle stage): their
    counts still come, so the absent clips' zeros agree with them."""
    from disttrain_core.data.producer_protocol import Want, decode_share, encode_share

    enc = encoder_for()
    rows = [enc.encode(f"{i}", interleaved("x", ("a.flac", clip()))) for i in range(4)]
    batch = collate(rows)
    want = Want.of(range(0, 2), ("tokens",))
    assert "audio_counts" in want.fields and "audio" not in want.fields
    meta, payload = encode_share(batch, 2, want)
    slots, summary = decode_share(meta, bytearray(payload), 2, 2, want, 1 << 26)
    assert [s.audio_counts.tolist() for s in slots] == [[1, 1], [1, 1]] and summary.clips.tolist() == [2, 2]
