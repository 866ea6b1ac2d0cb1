"""Training on Hugging Face datasets files (data.format=hf): a C4-style parquet text corpus stopped after step 3
and resumed gives the losses of an uninterrupted run (fp32, mapped and streaming); a LAION-style arrow file of image
bytes and captions trains mllm_tiny with its broken rows skipped and counted, and a data producer decoding the
same rows gives the same losses; a jsonl.gz corpus trains on two data-parallel processes."""

import gzip
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ..conftest import read_metrics, run_train

pytestmark = pytest.mark.distributed

TEXT = [
    "model=llama_tiny",
    "model.llm.dim=64",
    "model.llm.ffn_dim=128",
    "model.llm.n_layers=2",
    "model.seq_len=64",
]
COMMON = [
    "data=hf",
    "data.num_workers=0",
    "optim.global_batch_size=4",
    "optim.micro_batch_size=2",
    "trainer.precision=32",
    "trainer.accelerator=cpu",
    "trainer.checkpoint.every_n_steps=1",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=1",
]


def _train(run_dir, *overrides):
    result = run_train(COMMON + [f"hydra.run.dir={run_dir}", *overrides], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run_dir)


def _documents(n: int) -> list[str]:
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
    return [" ".join(words[(i * 7 + k) % len(words)] for k in range(8 + i % 9)) for i in range(n)]


@pytest.mark.parametrize("streaming", ["false", "true"])
def test_a_run_stopped_after_step_3_resumes_to_the_same_losses(tmp_path, streaming):
    path, held_out = tmp_path / "c4.parquet", tmp_path / "held_out" / "c4-validation.parquet"
    pq.write_table(pa.table({"text": _documents(40), "url": ["x"] * 40}), path)
    held_out.parent.mkdir()
    pq.write_table(pa.table({"text": _documents(48)[40:], "url": ["x"] * 8}), held_out)
    args = [*TEXT, f"data.path={path}", f"data.hf.streaming={streaming}", f"data.hf.cache_dir={tmp_path / 'cache'}"]
    args += [f"data.val.path={held_out}", "trainer.val_every_n_steps=2", "trainer.val_batches=2"]
    whole = _train(tmp_path / "whole", *args, "trainer.max_steps=5")
    stopped = _train(tmp_path / "cut", *args, "trainer.max_steps=5", "trainer.exit_after_step=3")
    assert len(stopped) == 3
    resumed = _train(tmp_path / "cut", *args, "trainer.max_steps=5", "trainer.resume=auto")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5]
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in whole], abs=1e-6, rel=0)
    val = {m["step"]: m["val/loss"] for m in whole if "val/loss" in m}  # held-out rows, steps 2, 4 and the last
    assert list(val) == [2, 4, 5] and all(0 < loss < 20 for loss in val.values())
    again = {m["step"]: m["val/loss"] for m in resumed if m["step"] in val}  # the stopped run also validated at 3
    assert again == pytest.approx(val, abs=1e-6, rel=0)


def _png(shade: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (24, 16), (shade, 60, 255 - shade)).save(out, "PNG")
    return out.getvalue()


def test_image_caption_arrow_trains_mllm_tiny_and_counts_broken_rows(tmp_path):
    captions = [f"a square of shade {i * 12}" for i in range(16)]
    images = [_png(i * 12) for i in range(16)]
    captions[2], images[5] = None, b"\x89PNG broken"  # missing_value, bad_image
    table = pa.table({"jpg": images, "caption": captions})
    path = tmp_path / "laion.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    args = ["model=mllm_tiny", f"data.path={path}", "data.hf.columns.text=caption", "data.hf.columns.image=jpg"]
    args += ["data.shuffle_shards=false", f"data.hf.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=2"]
    metrics = _train(tmp_path / "run", *args)
    assert len(metrics) == 2 and all(m["loss"] == m["loss"] for m in metrics)  # finite
    assert metrics[-1]["data/skipped_samples"] == 2  # rows 2 and 5 fall in the first 10 rows read
    # the same rows decoded by a data producer (its own process, a decode worker) give the same steps
    produced = _train(tmp_path / "produced", *args, "data.producer.workers=1")
    assert [m["loss"] for m in produced] == pytest.approx([m["loss"] for m in metrics], rel=1e-6)
    assert produced[-1]["data/skipped_samples"] == 2


def test_jsonl_gz_trains_on_two_processes(tmp_path):
    path = tmp_path / "corpus.jsonl.gz"
    with gzip.open(path, "wt") as out:
        out.writelines(json.dumps({"text": t}) + "\n" for t in _documents(24))
    metrics = _train(
        tmp_path / "run",
        *TEXT,
        f"data.path={path}",
        f"data.hf.cache_dir={tmp_path / 'cache'}",
        "trainer.devices=2",
        "trainer.max_steps=2",
    )
    assert [m["step"] for m in metrics] == [1, 2]
