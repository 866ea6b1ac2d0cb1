"""Samples during training (train/sampling.py) and the experiment trackers (train/trackers.py): one run with
trainer.sample_every_n_steps and logger=[tensorboard,csv,wandb,mlflow], every tracker read back with its own
reader (TensorBoard's event reader, the CSV, the W&B offline run file, the MLflow store); training bit-equal
with and without samples; tools/generate.py on the run's checkpoint."""

import csv
import json
import struct

import pytest
import torch
from PIL import Image

from ..conftest import REPO, read_metrics, run_script
from .test_units import SMALL, parameters, train

pytestmark = pytest.mark.distributed

SAMPLES = [
    "trainer.sample_every_n_steps=2",  # 5 steps: samples after steps 2, 4 and 5
    "trainer.samples.max_new_tokens=8",
    "trainer.samples.steps=4",
    "logger=[tensorboard,csv,wandb,mlflow]",
]


@pytest.fixture(scope="module")
def sampled(shards, tmp_path_factory):
    return train(shards, tmp_path_factory.mktemp("sampling") / "run", *SMALL, *SAMPLES)


def wandb_records(path):
    """The protobuf records of a W&B run file: a 7-byte header, then a LevelDB-style log (32 KiB blocks of
    records with a 7-byte header: checksum, length, kind 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    position, pending, records = 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + chunk)
            records.append(record)
            pending = b""
        elif kind in (2, 3):
            pending += chunk
    return records


def test_every_tracker_holds_the_same_series_and_the_samples(sampled):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = {m["step"]: m["loss"] for m in read_metrics(sampled)}
    assert sorted(logged) == [1, 2, 3, 4, 5]
    # TensorBoard: scalars, the config, text and an image grid at each sampling step
    events = {p.parent for p in (sampled / "tensorboard").rglob("events.out.tfevents.*")}
    board = EventAccumulator(str(events.pop()), size_guidance={"images": 0, "tensors": 0})
    board.Reload()
    assert {e.step: e.value for e in board.Scalars("train/loss")} == pytest.approx(logged, rel=1e-6)
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in board.Tensors("samples/text/text_summary")}
    assert sorted(texts) == [2, 4, 5] and "**photo of a red**" in texts[2]
    assert sorted(e.step for e in board.Images("samples/images")) == [2, 4, 5]
    assert "mllm_tiny" in board.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    # CSV (Fabric's CSVLogger)
    with open(sampled / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert {int(r["step"]): float(r["train/loss"]) for r in rows} == pytest.approx(logged, rel=1e-12)
    # W&B, offline: the run file's history records and its config
    (run_file,) = (sampled / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            if "train/loss" in items:
                history[int(items["_step"])] = json.loads(items["train/loss"])
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    assert history == pytest.approx(logged, rel=1e-12)
    assert config["model"]["name"] == "mllm_tiny"
    # MLflow: the SQLite store in the run directory
    client = MlflowClient(tracking_uri=f"sqlite:///{sampled / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("disttrain").experiment_id])
    series = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert series == pytest.approx(logged, rel=1e-12)
    assert run.data.params["model.name"] == "mllm_tiny"
    images = client.list_artifacts(run.info.run_id, "samples/images")
    assert sorted(a.path.rsplit("/", 1)[-1] for a in images) == [f"step_{s:08d}.png" for s in (2, 4, 5)]
    # the run directory: a grid of the 4 captions' images and the texts per sampling step
    for step in (2, 4, 5):
        record = json.loads((sampled / "samples" / f"step_{step:08d}.json").read_text())
        assert [t["prompt"] for t in record["texts"]] == ["photo of a red", "drawing of a"]
        with Image.open(sampled / "samples" / record["png"]) as grid:
            assert grid.size == (2 + 4 * (32 + 2), 2 + 32 + 2)
    assert all("samples/seconds" in m for m in read_metrics(sampled) if m["step"] in (2, 4, 5))


def test_sampling_leaves_training_bit_equal(sampled, shards, tmp_path):
    plain = train(shards, tmp_path / "plain", *SMALL, "logger=jsonl")
    assert [(m["step"], m["loss"]) for m in read_metrics(plain)] == [
        (m["step"], m["loss"]) for m in read_metrics(sampled)
    ]
    ours, theirs = parameters(sampled), parameters(plain)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_generate_tool_reads_the_checkpoint_and_its_cache_changes_no_token(sampled, tmp_path):
    def run(*options):
        done = run_script(REPO / "tools" / "generate.py", [f"path={sampled}", *options], timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

    cached = run("prompt=photo of a|drawing", "max_new_tokens=24")
    uncached = run("prompt=photo of a|drawing", "max_new_tokens=24", "cache=false")
    assert [r["text"] for r in cached] == [r["text"] for r in uncached]
    assert [r["prompt"] for r in cached] == ["photo of a", "drawing"] and cached[0]["step"] == 5
    sampled_texts = run("prompt=photo of a", "temperature=1.0", "top_p=0.9", "samples=3", "max_new_tokens=24")
    assert len(sampled_texts) == 3 and len({r["text"] for r in sampled_texts}) > 1
    (images,) = run("images=true", "prompt=photo of a red circle on white", "samples=2", f"out={tmp_path}/g.png")
    with Image.open(images["png"]) as grid:
        assert grid.size == (2 + 2 * (32 + 2), 2 + 32 + 2)


def test_a_pipeline_samples_from_the_checkpoint_of_each_sampling_step(shards, tmp_path):
    """parallel=pp2: no rank holds the whole model, so rank 0 samples from the checkpoint saved at each sampling
    step (steps 2, 4 and the last, 5); training is bit-equal with and without it, and the step-5 texts are those
    tools/generate.py draws from that checkpoint."""
    layout = [*SMALL, "parallel=pp2", "schedule=1f1b", "trainer.devices=2", "trainer.checkpoint.every_n_steps=2"]
    samples = ["trainer.sample_every_n_steps=2", "trainer.samples.max_new_tokens=8", "trainer.samples.steps=4"]
    run = train(shards, tmp_path / "run", *layout, *samples)
    plain = train(shards, tmp_path / "plain", *layout)
    assert [(m["step"], m["loss"]) for m in read_metrics(run)] == [(m["step"], m["loss"]) for m in read_metrics(plain)]
    written = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in (run / "samples").glob("*.json")}
    assert sorted(written) == [2, 4, 5] and all((run / "samples" / w["png"]).is_file() for w in written.values())
    done = run_script(
        REPO / "tools" / "generate.py", [f"path={run}", "prompt=photo of a red|drawing of a", "max_new_tokens=8"]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    generated = [json.loads(line)["text"] for line in done.stdout.splitlines() if line.startswith("{")]
    assert [t["text"] for t in written[5]["texts"]] == generated
