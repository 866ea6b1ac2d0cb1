"""Shards behind URLs (data/storage.py): the same shards read from a local directory, an HTTP server with range
requests, an S3 server (moto), ``file://`` and ``pipe:cat`` give the same stream -- interleaving, park/reopen at
byte offsets, exact resume, skipped-and-counted bad samples -- and validation refuses an unreachable URL in one
line, quickly. Every server runs on 127.0.0.1 inside the test."""

from __future__ import annotations

import functools
import gzip
import http.server
import io
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from disttrain_core.config import compose
from disttrain_core.data import storage
from disttrain_core.data.loader import MicrobatchLoader
from disttrain_core.data.reader import RawSample, ShardStream, resolve_shards, shard_sample_counts
from disttrain_core.data.samples import SampleEncoder
from disttrain_core.data.tokenizer import ByteTokenizer
from disttrain_core.validation import ConfigError
from disttrain_core.validation.data import check_shards

from ..conftest import write_tar

BUCKET = "disttrain-shards"
SHARDS = 4  # shard-0 .. shard-3: plain, one bad image, truncated, gzip
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _jpeg(side: int, color: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), color).save(buffer, format="JPEG")
    return buffer.getvalue()


def _samples(shard: int) -> list[tuple[str, dict[str, bytes]]]:
    out = []
    for i in range(6):
        image = _jpeg(24 + 8 * i, (40 * shard, 30 * i, 90))
        if shard == 1 and i == 2:
            image = b"not an image at all"
        out.append((f"{shard}{i:03d}", {"jpg": image, "txt": f"shard {shard} sample {i}".encode()}))
    return out


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("url-shards")
    for shard in range(SHARDS):
        write_tar(out / f"shard-{shard}.tar", _samples(shard))
    whole = (out / "shard-2.tar").read_bytes()
    with tarfile.open(out / "shard-2.tar") as archive:
        cut = archive.getmembers()[8].offset_data + 100  # inside the fifth sample's image: a ShardError there
    (out / "shard-2.tar").write_bytes(whole[:cut])
    (out / "shard-3.tar").write_bytes(gzip.compress((out / "shard-3.tar").read_bytes()))  # .tar name, gzip bytes
    (out / "cut-0.bin").write_bytes((out / "shard-0.tar").read_bytes())  # served with a broken connection
    return out


# ------------------------------------------------------------------------------------------------ servers
class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """GET and HEAD of the served directory's files, with ``Range: bytes=a-b`` (206 + Content-Range). A ``cut-``
    file's ranges past its first 8 kB break off half way: a connection lost mid-shard."""

    def log_message(self, *args) -> None:
        pass

    def _serve(self, body: bool) -> None:
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return
        data = Path(path).read_bytes()
        start, end = 0, len(data) - 1
        wanted = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", ""))
        if wanted and (wanted.group(1) or wanted.group(2)):
            if wanted.group(1):
                start = int(wanted.group(1))
                end = min(int(wanted.group(2)), end) if wanted.group(2) else end
            else:  # the last N bytes
                start = max(0, len(data) - int(wanted.group(2)))
            if start > end:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/x-tar")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        if body:
            broken = os.path.basename(path).startswith("cut-") and start >= 8192
            self.wfile.write(data[start : (start + end + 1) // 2 if broken else end + 1])

    def do_GET(self) -> None:
        self._serve(True)

    def do_HEAD(self) -> None:
        self._serve(False)


@pytest.fixture(scope="module")
def http_url(shard_dir):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(RangeHandler, directory=shard_dir))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def moto_endpoint(shard_dir):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **_boto_credentials())
    client.create_bucket(Bucket=BUCKET)
    for shard in sorted(shard_dir.iterdir()):
        client.put_object(Bucket=BUCKET, Key=f"shards/{shard.name}", Body=shard.read_bytes())
    client.put_object(Bucket=BUCKET, Key="shards/notes.txt", Body=b"not a shard")
    yield endpoint
    server.stop()


def _boto_credentials() -> dict[str, str]:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


def _clear_fsspec_instances() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3(moto_endpoint, monkeypatch):
    """Credentials in the environment, the endpoint through data.storage_options; everything undone after."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("FSSPEC_S3", raising=False)  # restored (removed) after the test
    _clear_fsspec_instances()
    storage.configure(SimpleNamespace(storage_options={"s3": {"endpoint_url": moto_endpoint}}))
    yield moto_endpoint
    storage.configure(SimpleNamespace(storage_options=None))
    _clear_fsspec_instances()


@pytest.fixture
def sources(shard_dir, http_url, s3) -> dict[str, str]:
    """The same four shards as a local directory and as URLs of every kind."""
    names = f"shard-{{0..{SHARDS - 1}}}.tar"
    return {
        "local": str(shard_dir),
        "http": f"{http_url}/{names}",
        "s3": f"s3://{BUCKET}/shards/{names}",
        "file": f"file://{shard_dir}/{names}",
        "pipe": f"pipe:cat {shard_dir}/{names}",
    }


# ------------------------------------------------------------------------------------------------- stream
def _view(elements) -> list[tuple]:
    out = []
    for element in elements:
        item = element.item
        if isinstance(item, RawSample):
            out.append((element.position, item.key, item.members))
        else:
            out.append((element.position, "shard_error", item.shard))
    return out


def test_urls_give_the_local_stream_with_park_reopen_and_exact_resume(sources):
    shards = {kind: resolve_shards(path) for kind, path in sources.items()}
    assert all(len(found) == SHARDS for found in shards.values()), shards
    count = 2 * (3 * 6 + 4) + 5  # past the end of the first epoch (truncated shard: some samples and an error)
    reference = None
    for kind, found in shards.items():
        for max_open in (16, 1):  # 1: every shard is parked and reopened at an offset after each sample
            stream = ShardStream(found, 0, 1, seed=3, max_open=max_open)
            seen = _view(itertools.islice(stream.elements(), count))
            reference = reference or seen
            assert seen == reference, (kind, max_open)
        resumed = ShardStream(found, 0, 1, seed=3, max_open=2).elements(reference[20][0])
        assert _view(itertools.islice(resumed, count - 20)) == reference[20:], kind
    errors = [entry for entry in reference if entry[1] == "shard_error"]
    assert errors and all(entry[2] == "shard-2.tar" for entry in errors)
    assert {key.split("/")[0] for _, key, _ in reference if key != "shard_error"} == {
        f"shard-{i}.tar" for i in range(SHARDS)
    }


def test_two_ranks_read_disjoint_url_shards(sources):
    found = resolve_shards(sources["s3"])
    a = {e.item.key for e in itertools.islice(ShardStream(found, 0, 2, seed=1).elements(), 8)}
    b = {e.item.key for e in itertools.islice(ShardStream(found, 1, 2, seed=1).elements(), 8)}
    assert a and b and not {k.split("/")[0] for k in a} & {k.split("/")[0] for k in b}


def test_sample_counts_from_urls(sources):
    readable = [0, 1, 3]  # the truncated shard cannot be counted from its headers
    for kind in ("http", "s3", "file", "pipe"):
        found = [resolve_shards(sources[kind])[i] for i in readable]
        assert shard_sample_counts(found) == [6, 6, 6], kind


def test_loaders_skip_and_count_the_same(sources):
    encoder = SampleEncoder(compose([]).model, ByteTokenizer(), seed=0, max_image_pixels=64_000_000)
    results = {}
    for kind in ("local", "http", "s3", "pipe"):
        workers = 1 if kind == "s3" else 0  # a forked decode worker reads the bucket too
        stream = ShardStream(resolve_shards(sources[kind]), 0, 1, seed=4)
        loader = MicrobatchLoader(stream, encoder, micro_batch_size=4, microbatches_per_step=2, num_workers=workers)
        keys = [mb.keys for _ in range(3) for mb in loader.next_step()]  # past the truncation
        results[kind] = (keys, loader.state_dict())
    assert all(result == results["local"] for result in results.values()), results
    skipped = results["local"][1]["skipped"]
    assert skipped.get("bad_image") == 1 and skipped.get("shard_error") == 1, skipped


def test_unreadable_url_shards_are_shard_errors(http_url, shard_dir, monkeypatch):
    """A shard that is not there, a command that fails, a connection lost mid-shard: ShardError, skipped and
    counted like a truncated file; the samples before the break stay valid."""
    for url in (f"{http_url}/missing.tar", f"pipe:cat {shard_dir}/missing.tar"):
        items = [e.item for e in ShardStream([url], 0, 1, seed=0).epoch_elements(0)]
        assert len(items) == 1 and items[0].shard == "missing.tar" and not isinstance(items[0], RawSample), items
    monkeypatch.delenv("FSSPEC_HTTP", raising=False)
    storage.configure(SimpleNamespace(storage_options={"http": {"block_size": 4096}}))  # small reads: several
    try:
        items = [e.item for e in ShardStream([f"{http_url}/cut-0.bin"], 0, 1, seed=0).epoch_elements(0)]
    finally:
        storage.configure(SimpleNamespace(storage_options=None))
    assert [type(i).__name__ for i in items] == ["RawSample"] * 3 + ["ShardError"], items
    assert items[-1].shard == "cut-0.bin" and "payload" in items[-1].reason.lower(), items[-1]


# -------------------------------------------------------------------------------------------------- names
def test_brace_glob_and_directory_names_on_s3(s3):
    base = f"s3://{BUCKET}/shards"
    expected = [f"{base}/shard-{i}.tar" for i in range(SHARDS)]
    found, missing = storage.expand(f"{base}/shard-{{0..5}}.tar")
    assert found == expected and missing == [f"{base}/shard-4.tar", f"{base}/shard-5.tar"]
    assert storage.expand(f"{base}/*.tar") == (expected, [])
    assert storage.expand(f"{base}/shard-{{0,3}}*") == ([expected[0], expected[3]], [])
    assert storage.expand(f"{base}/") == (expected, [])
    assert storage.expand(base) == (expected, [])  # a prefix that is a "directory"
    assert storage.expand(f"{base}/nothing-*.tar") == ([], [f"{base}/nothing-*.tar"])
    assert resolve_shards(f"{base}/shard-{{0..5}}.tar") == expected  # the missing ones are left out


def test_shard_names_and_url_detection():
    assert storage.shard_name("s3://b/p/shard-7.tar") == "shard-7.tar"
    assert storage.shard_name("https://host/x/shard-7.tar?sig=abc") == "shard-7.tar"
    assert storage.shard_name("pipe:curl -s -L https://host/x/shard-7.tar") == "shard-7.tar"
    assert storage.shard_name("pipe:aws s3 cp s3://b/shard-7.tar -") == "-"  # the last word, as documented
    assert all(map(storage.is_url, ("s3://b/x", "gs://b/x", "https://h/x", "file:///x", "pipe:cat x")))
    assert not any(map(storage.is_url, ("/data/x.tar", "data/{0..3}.tar", "relative/s3:x")))


def test_forward_reader_seeks_like_tarfile_needs():
    reader = storage.ForwardReader(io.BytesIO(bytes(range(256)) * 1024))
    assert reader.read(10) == bytes(range(10)) and reader.tell() == 10
    assert reader.seek(3) == 3 and reader.read(2) == b"\x03\x04"  # back, inside the kept tail
    assert reader.seek(70_000) == 70_000 and reader.read(1) == bytes([70_000 % 256])  # forward: read and dropped
    assert reader.seek(69_999) == 69_999 and reader.read(2) == bytes([69_999 % 256, 70_000 % 256])
    with pytest.raises(OSError, match="cannot seek back"):
        reader.seek(5)
    assert reader.seek(10**9) == 256 * 1024 and reader.read(4) == b""  # past the end: at the end


# -------------------------------------------------------------------------------------- options, validation
def test_storage_options_reach_fsspec_and_child_processes(s3):
    import fsspec.config

    assert fsspec.config.conf["s3"]["endpoint_url"] == s3
    assert json.loads(os.environ["FSSPEC_S3"]) == {"endpoint_url": s3}
    code = "import fsspec.config, json; print(json.dumps(fsspec.config.conf.get('s3')))"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(child.stdout) == {"endpoint_url": s3}
    storage.configure(SimpleNamespace(storage_options={"s3": {"anon": True}}))  # replaces, not adds
    assert fsspec.config.conf["s3"] == {"anon": True} and json.loads(os.environ["FSSPEC_S3"]) == {"anon": True}
    storage.configure(SimpleNamespace(storage_options=None))
    assert "s3" not in fsspec.config.conf and "FSSPEC_S3" not in os.environ


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _data_cfg(path: str, *overrides: str):
    return compose([f"data.path='{path}'", "data.generate_if_missing=true", *overrides])


def _refusal(cfg) -> str:
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        check_shards(cfg)
    assert time.monotonic() - started < 10, "an unreachable URL must be refused quickly"
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_validation_reads_urls_and_refuses_unreachable_ones_in_one_line(s3, http_url):
    endpoint = f"data.storage_options={{s3:{{endpoint_url:'{s3}'}}}}"
    assert check_shards(_data_cfg(f"s3://{BUCKET}/shards/shard-{{0..3}}.tar", endpoint)) == SHARDS
    assert check_shards(_data_cfg(f"{http_url}/shard-{{0..3}}.tar")) == SHARDS
    message = _refusal(_data_cfg("s3://no-such-bucket/x-{0..3}.tar", endpoint))
    assert message.startswith("data.path='s3://no-such-bucket/x-{0..3}.tar': cannot reach it (")
    assert "bucket does not exist" in message and "data.storage_options.s3.endpoint_url" in message, message
    message = _refusal(_data_cfg(f"http://127.0.0.1:{_closed_port()}/shard-{{0..3}}.tar"))
    assert "cannot reach it (Cannot connect to host" in message, message
    assert "(404" in _refusal(_data_cfg(f"{http_url}/missing-{{0..3}}.tar")), "a 404 names its status"
    closed = f"data.storage_options={{s3:{{endpoint_url:'http://127.0.0.1:{_closed_port()}'}}}}"
    message = _refusal(_data_cfg(f"s3://{BUCKET}/shards/shard-{{0..3}}.tar", closed))
    assert "cannot reach it (Could not connect to the endpoint URL" in message, message
    # a bucket that answers but holds no shards there: an error, never generated into
    message = _refusal(_data_cfg(f"s3://{BUCKET}/elsewhere/*.tar", endpoint))
    assert "no .tar shards found there" in message and "local data only" in message, message
    assert "credentials do not go in the config" in _refusal(
        _data_cfg(f"s3://{BUCKET}/shards/", "data.storage_options={s3:{secret:abc}}")
    )
    assert "give a mapping from a protocol" in _refusal(_data_cfg(f"s3://{BUCKET}/x", "data.storage_options=bogus"))


def test_a_server_that_never_answers_is_given_up_on(monkeypatch):
    """A server that accepts the connection and says nothing: refused after storage.PROBE_TIMEOUT_S (1 s here)."""
    monkeypatch.setattr(storage, "PROBE_TIMEOUT_S", 1.0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # never accepted: the kernel completes the handshake, nobody answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/shard-{{0..3}}.tar"
        assert "cannot reach it (no answer within 1 s)" in _refusal(_data_cfg(url))


# ----------------------------------------------------------------------------------------------- training
def test_training_reads_the_same_shards_from_http_s3_and_disk_with_the_same_losses(shard_dir, http_url, s3, tmp_path):
    """train.py for 3 steps of 4 samples (3 from each shard): the local directory, the HTTP server and the S3
    server give the same fp32 losses and skip the same bad sample (shard 1's third, not an image)."""
    from ..conftest import cli_overrides, read_metrics, run_train

    names = f"shard-{{0..{SHARDS - 1}}}.tar"
    paths = {"local": str(shard_dir), "http": f"{http_url}/{names}", "s3": f"s3://{BUCKET}/shards/{names}"}
    common = [
        "trainer.devices=1",
        "trainer.max_steps=3",
        "trainer.precision=32",
        "optim.global_batch_size=4",
        "optim.micro_batch_size=2",
        "trainer.checkpoint.every_n_steps=0",
        "data.shuffle_shards=false",
        f"data.storage_options={{s3:{{endpoint_url:'{s3}'}}}}",
    ]
    runs = {}
    for kind, path in paths.items():
        run_dir = tmp_path / kind
        overrides = [o for o in cli_overrides(shard_dir, run_dir) if not o.startswith("data.path=")]
        result = run_train([*overrides, f"data.path='{path}'", *common], timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        metrics = [m for m in read_metrics(run_dir) if "loss" in m]
        runs[kind] = ([m["loss"] for m in metrics], metrics[-1]["data/skipped_samples"])
    assert len(runs["local"][0]) == 3 and runs["local"][1] >= 1, runs
    assert runs["http"] == runs["local"] and runs["s3"] == runs["local"], runs
