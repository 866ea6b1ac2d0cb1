"""The data producer: same global batches whatever the workers and the reordering, exact resume,
an authenticated transport that survives bad clients, and a dead producer reported in time."""

import socket
import time

import pytest
from omegaconf import OmegaConf

from disttrain_core.data.producer import BatchAssembler, Layout, ProducerLoader, start_local_producer
from disttrain_core.data.transport import HEADER, MAGIC, VERSION, client_channel, load_key, new_key

pytestmark = pytest.mark.distributed

LAYOUT = Layout(slots=2, samples_per_slot=4, groups=2, stages=2, world=1)


@pytest.fixture
def cfg(compose_cfg):
    return compose_cfg("data.producer.timeout_s=5")


def keys_of(assembler: BatchAssembler, steps: int) -> list[list[str]]:
    return [assembler.next()[1].keys for _ in range(steps)]


def test_global_batches_do_not_depend_on_workers_or_reordering_and_resume_exactly(compose_cfg):
    plain = compose_cfg(
        "data.producer.workers=0", "data.producer.reorder.intra=false", "data.producer.reorder.inter=false"
    )
    reordered = compose_cfg("data.producer.workers=2")
    a = keys_of(BatchAssembler(plain, LAYOUT, {}), 8)
    b = keys_of(BatchAssembler(reordered, LAYOUT, {}), 8)
    assert [sorted(x) for x in a] == [sorted(x) for x in b]  # the same samples in every step
    assert a != b  # ... in a different order

    straight = BatchAssembler(reordered, LAYOUT, {})
    for _ in range(3):
        _, _, state = straight.next()
    resumed = BatchAssembler(reordered, LAYOUT, state)
    assert keys_of(resumed, 5) == keys_of(straight, 5)


def test_producer_serves_batches_and_refuses_bad_clients(cfg):
    key = new_key()
    container = OmegaConf.to_container(cfg, resolve=True)
    process, address = start_local_producer(cfg, container, key)
    host, _, port = address.rpartition(":")
    try:
        # wrong key: the first frame fails authentication and the connection is dropped
        wrong = ProducerLoader(address, load_key(new_key()), LAYOUT, {}, 5.0, 1 << 26)
        with pytest.raises(RuntimeError, match="lost the data producer|sent nothing"):
            wrong.next_step()
        # garbage and an oversized frame: rejected, the producer keeps serving
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.recv(4 + 2 + 32)
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100)
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            channel = client_channel(raw, load_key(key), 1 << 26)  # noqa: F841 (handshake only)
            raw.sendall(HEADER.pack(MAGIC, VERSION, 3, 10, 1 << 40))  # claims a petabyte
            time.sleep(0.2)
        good = ProducerLoader(address, load_key(key), LAYOUT, {}, 10.0, 1 << 26)
        slots = good.next_step()
        assert len(slots) == LAYOUT.slots and all(s.size == LAYOUT.samples_per_slot for s in slots)
        assert good.state_dict()["step"] == 1
        # a dead producer is reported within the timeout, not a hang
        process.kill()
        process.join(timeout=10)
        started = time.time()
        with pytest.raises(RuntimeError, match="data producer"):
            good.next_step()
        assert time.time() - started < 15
    finally:
        if process.is_alive():
            process.kill()


def test_training_through_a_producer_resumes_exactly(shards, tmp_path):
    """train.py starts its producer; a run stopped after step 3 and resumed matches a straight run."""
    from ..conftest import cli_overrides, read_metrics, run_train

    common = ["data.producer.workers=1", "trainer.max_steps=5", "optim.global_batch_size=8", "optim.micro_batch_size=2"]
    straight = run_train(cli_overrides(shards, tmp_path / "straight") + common)
    assert straight.returncode == 0, straight.stderr[-3000:]
    run = tmp_path / "resumed"
    first = run_train(cli_overrides(shards, run) + common + ["trainer.exit_after_step=3"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train(cli_overrides(shards, run) + common + ["trainer.resume=auto"])
    assert second.returncode == 0, second.stderr[-3000:]
    expected = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "straight")}
    resumed = {m["step"]: m["loss"] for m in read_metrics(run)}
    assert [resumed[s] for s in (4, 5)] == pytest.approx([expected[4], expected[5]], abs=1e-6)


def test_reordering_keeps_synchronous_semantics_across_units(shards, tmp_path):
    """Encoder and LLM units (2 processes) fed by a producer: reordering on and off give the same
    losses (same samples per step; only the summation order changes)."""
    from ..conftest import cli_overrides, read_metrics, run_train

    common = [
        "parallel=disagg2",
        "data.producer.workers=1",
        "trainer.max_steps=3",
        "trainer.precision=32",
        "optim.global_batch_size=8",
        "optim.micro_batch_size=2",
        "trainer.checkpoint.every_n_steps=0",
    ]
    runs = {}
    for flag in ("true", "false"):
        reorder = [f"data.producer.reorder.intra={flag}", f"data.producer.reorder.inter={flag}"]
        result = run_train(cli_overrides(shards, tmp_path / flag) + common + reorder)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[flag] = [m["loss"] for m in read_metrics(tmp_path / flag)]
    assert runs["true"] == pytest.approx(runs["false"], abs=1e-4)


def test_standalone_producer_command(compose_cfg, shards):
    import os
    import subprocess
    import sys

    from disttrain_core.config import REPO_ROOT

    key = new_key()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DISTTRAIN_PRODUCER_KEY": key}
    overrides = [f"data.path={shards}", "data.generate_if_missing=false"]
    server = subprocess.Popen(
        [sys.executable, "-m", "disttrain_core.data.producer", "--listen", f"127.0.0.1:{port}", *overrides],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 60
        while True:
            try:
                loader = ProducerLoader(f"127.0.0.1:{port}", load_key(key), LAYOUT, {}, 20.0, 1 << 26)
                break
            except RuntimeError:
                assert time.time() < deadline, "the standalone producer did not come up"
                time.sleep(0.5)
        first = loader.next_step()
        assert [s.size for s in first] == [LAYOUT.samples_per_slot] * LAYOUT.slots
        # the job stops and resumes: a new session from the saved state gets the next batch
        state = loader.state_dict()
        loader.close()
        time.sleep(0.5)
        resumed = ProducerLoader(f"127.0.0.1:{port}", load_key(key), LAYOUT, state, 20.0, 1 << 26)
        second = resumed.next_step()
        assert resumed.state_dict()["step"] == 2
        assert not set(first[0].keys) & set(second[0].keys)
    finally:
        server.kill()
        server.wait(timeout=10)
