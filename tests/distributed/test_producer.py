"""The data producer: same global batches whatever the workers and the reordering, exact resume,
an authenticated transport that survives bad clients, and a dead producer reported in time."""

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from disttrain_core.data.producer import (
    BatchAssembler,
    Layout,
    ProducerLoader,
    ProducerServer,
    job_identity,
    start_local_producer,
    stop_local_producer,
)
from disttrain_core.data.transport import GREETING, HEADER, MAGIC, VERSION, client_channel, load_key, new_key

pytestmark = pytest.mark.distributed

# A short fp32 train.py run fed by the producer train.py starts (tests compare losses between such runs)
PRODUCER_RUN = [
    "data.producer.workers=1",
    "trainer.max_steps=3",
    "trainer.precision=32",
    "optim.global_batch_size=8",
    "optim.micro_batch_size=2",
    "trainer.checkpoint.every_n_steps=0",
]
LAYOUT = Layout(slots=2, samples_per_slot=4, groups=2, stages=2, world=1)


def layout_for(cfg, world: int = 1) -> Layout:
    """LAYOUT with the trainers' identity (what trainer_layout sends) and ``world`` ranks."""
    return replace(LAYOUT, world=world, job=tuple(sorted(job_identity(cfg).items())))


@pytest.fixture
def cfg(compose_cfg):
    return compose_cfg("data.producer.timeout_s=5")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def in_process():
    """A ProducerServer on a thread of this process (decoding inline: data.producer.workers=0)."""
    servers = []

    def start(cfg, key: str) -> str:
        server = ProducerServer(cfg, load_key(key), "127.0.0.1:0")
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.address

    yield start
    for server in servers:
        server.close()


def keys(slots) -> list[str]:
    return [key for slot in slots for key in slot.keys]


def keys_of(assembler: BatchAssembler, steps: int) -> list[list[str]]:
    return [assembler.next().batch.keys for _ in range(steps)]


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
        state = straight.next().state
    resumed = BatchAssembler(reordered, LAYOUT, state)
    assert keys_of(resumed, 5) == keys_of(straight, 5)


def test_producer_serves_batches_and_refuses_bad_clients(cfg):
    key = new_key()
    container = OmegaConf.to_container(cfg, resolve=True)
    process, address = start_local_producer(cfg, container, key)
    host, _, port = address.rpartition(":")
    layout = layout_for(cfg)
    try:
        # wrong key: the HELLO fails authentication, and the trainer says so at once
        started = time.time()
        with pytest.raises(RuntimeError, match="do not share a key"):
            ProducerLoader(address, load_key(new_key()), layout, {}, 5.0, 1 << 26)
        assert time.time() - started < 3
        # garbage and an oversized frame: rejected, the producer keeps serving
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.recv(GREETING.size)
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100)
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            channel = client_channel(raw, load_key(key), 1 << 26)  # noqa: F841 (greetings only)
            raw.sendall(HEADER.pack(MAGIC, VERSION, 3, 10, 1 << 40))  # claims a petabyte
            time.sleep(0.2)
        good = ProducerLoader(address, load_key(key), layout, {}, 5.0, 1 << 26)
        slots = good.next_step()
        assert len(slots) == LAYOUT.slots and all(s.size == LAYOUT.samples_per_slot for s in slots)
        assert good.state_dict()["step"] == 1
        # a dead producer is reported once reconnecting has failed for timeout_s, not a hang
        process.kill()
        process.join(timeout=10)
        started = time.time()
        with pytest.raises(RuntimeError, match="lost the data producer .* no producer answered there for 5 s"):
            good.next_step()
        assert time.time() - started < 8
    finally:
        if process.is_alive():
            process.kill()


# make test-slow: tests/faults/test_interruptions.py resumes through a producer after a restart (equal losses)
@pytest.mark.slow
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

    common = ["parallel=disagg2", *PRODUCER_RUN]
    runs = {}
    for flag in ("true", "false"):
        reorder = [f"data.producer.reorder.intra={flag}", f"data.producer.reorder.inter={flag}"]
        result = run_train(cli_overrides(shards, tmp_path / flag) + common + reorder)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[flag] = [m["loss"] for m in read_metrics(tmp_path / flag)]
    assert runs["true"] == pytest.approx(runs["false"], abs=1e-4)


def test_standalone_producer_command(compose_cfg, shards):
    from disttrain_core.config import REPO_ROOT

    key = new_key()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DISTTRAIN_PRODUCER_KEY": key}
    overrides = [f"data.path={shards}", "data.generate_if_missing=false"]
    layout = layout_for(compose_cfg(*overrides))
    server = subprocess.Popen(
        [sys.executable, "-m", "disttrain_core.launch.producer", "--listen", f"127.0.0.1:{port}", *overrides],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 60
        while True:
            try:
                loader = ProducerLoader(f"127.0.0.1:{port}", load_key(key), layout, {}, 20.0, 1 << 26)
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
        resumed = ProducerLoader(f"127.0.0.1:{port}", load_key(key), layout, state, 20.0, 1 << 26)
        second = resumed.next_step()
        assert resumed.state_dict()["step"] == 2
        assert not set(first[0].keys) & set(second[0].keys)
    finally:
        server.kill()
        server.wait(timeout=10)


def test_standalone_producer_validates_its_config():
    from disttrain_core.config import REPO_ROOT

    env = {**os.environ, "DISTTRAIN_PRODUCER_KEY": new_key()}
    command = [sys.executable, "-m", "disttrain_core.launch.producer", "--listen", "127.0.0.1:0"]
    command.append("data.producer.max_connections=0")
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: data.producer.max_connections=0")


def test_trainers_with_another_seed_model_or_tokenizer_are_refused(compose_cfg, in_process):
    key = new_key()
    mine = compose_cfg()
    address = in_process(mine, key)
    other = layout_for(compose_cfg("model.seq_len=128", "trainer.seed=7"))
    with pytest.raises(RuntimeError) as refused:
        ProducerLoader(address, load_key(key), other, {}, 5.0, 1 << 26)
    message = str(refused.value)
    assert "refused this trainer" in message
    assert "producer has model.seq_len=256, trainer has model.seq_len=128" in message
    assert f"producer has trainer.seed={mine.trainer.seed}, trainer has trainer.seed=7" in message
    # a trainer that sends no identity at all is refused too
    with pytest.raises(RuntimeError, match="did not send its seed, model and tokenizer"):
        ProducerLoader(address, load_key(key), LAYOUT, {}, 5.0, 1 << 26)


def test_a_producer_that_cannot_make_batches_tells_the_trainers_why(compose_cfg, in_process, tmp_path, monkeypatch):
    empty = tmp_path / "no_shards"
    empty.mkdir()
    key = new_key()
    cfg = compose_cfg(f"data.path={empty}", "data.generate_if_missing=true")
    address = in_process(cfg, key)
    layout = layout_for(cfg)
    first = ProducerLoader(address, load_key(key), layout, {}, 5.0, 1 << 26)
    with pytest.raises(RuntimeError, match="no .tar shards at data.path=.*no_shards"):
        first.next_step()
    with pytest.raises(RuntimeError, match="no .tar shards at data.path=.*no_shards"):  # a new trainer, too
        ProducerLoader(address, load_key(key), layout, {}, 5.0, 1 << 26).next_step()

    # a decode that crashes: its exception, not a timeout or "lost the data producer"
    from disttrain_core.data.samples import SampleEncoder

    def crash(self, key, members):
        raise MemoryError("decoder ran out of memory on " + key)

    monkeypatch.setattr(SampleEncoder, "plan", crash)
    good = compose_cfg()
    address = in_process(good, key)
    loader = ProducerLoader(address, load_key(key), layout_for(good), {}, 5.0, 1 << 26)
    with pytest.raises(RuntimeError, match="MemoryError: decoder ran out of memory on shard-"):
        loader.next_step()


def test_a_dropped_connection_reconnects_to_the_live_producer(compose_cfg, in_process):
    """Two trainer ranks (world=2); each loses its connection once and asks again for a step the producer
    still holds. A third trainer at another position is refused while they are connected."""
    cfg = compose_cfg("data.producer.prefetch_steps=1")
    key = new_key()
    address = in_process(cfg, key)
    layout = layout_for(cfg, world=2)
    expected = keys_of(BatchAssembler(cfg, layout, {}), 4)
    a, b = (ProducerLoader(address, load_key(key), layout, {}, 10.0, 1 << 26) for _ in range(2))
    got = {"a": [keys(a.next_step())], "b": [keys(b.next_step())]}
    got["a"].append(keys(a.next_step()))
    a.channel.sock.shutdown(socket.SHUT_RDWR)  # the network drops a after it has step 2
    got["b"].append(keys(b.next_step()))
    b.channel.sock.shutdown(socket.SHUT_RDWR)  # ... and b
    for _ in range(2):
        got["a"].append(keys(a.next_step()))
        got["b"].append(keys(b.next_step()))
    assert (a.reconnects, b.reconnects) == (1, 1)
    assert got["a"] == got["b"] == expected
    with pytest.raises(RuntimeError, match="refused this trainer: this trainer continues after step 9"):
        ProducerLoader(address, load_key(key), layout, {"step": 9, "epoch": 0, "index": 72}, 5.0, 1 << 26)


def test_trainers_continue_the_same_stream_from_a_restarted_producer(compose_cfg):
    """Kill the producer process after step 2; a new one (with a decode worker) starts 1 s later on the same
    address. Both ranks (world=2) reconnect with backoff and continue: the same batches as an uninterrupted
    stream. Asked to stop, the new producer exits cleanly at once (its decode worker ignores SIGTERM)."""
    port = free_port()
    cfg = compose_cfg(f"data.producer.listen=127.0.0.1:{port}")
    container = OmegaConf.to_container(cfg, resolve=True)
    with_worker = OmegaConf.to_container(
        compose_cfg(f"data.producer.listen=127.0.0.1:{port}", "data.producer.workers=1")
    )
    key = new_key()
    layout = layout_for(cfg, world=2)
    expected = keys_of(BatchAssembler(cfg, layout, {}), 5)
    process, address = start_local_producer(cfg, container, key)
    processes = [process]
    try:
        a, b = (ProducerLoader(address, load_key(key), layout, {}, 30.0, 1 << 26) for _ in range(2))
        got = {"a": [], "b": []}
        for _ in range(2):
            got["a"].append(keys(a.next_step()))
            got["b"].append(keys(b.next_step()))
        process.kill()
        process.join(timeout=10)

        def restart():
            time.sleep(1.0)
            processes.append(start_local_producer(cfg, with_worker, key)[0])

        restarter = threading.Thread(target=restart)
        restarter.start()
        for _ in range(3):
            got["a"].append(keys(a.next_step()))
            got["b"].append(keys(b.next_step()))
        restarter.join(timeout=60)
        assert (a.reconnects, b.reconnects) == (1, 1)
        assert got["a"] == got["b"] == expected
        started = time.monotonic()
        stop_local_producer(processes[-1])
        assert processes[-1].exitcode == 0 and time.monotonic() - started < 5, processes[-1].exitcode
    finally:
        for each in processes:
            each.kill()
            each.join(timeout=10)


@pytest.mark.slow
def test_training_continues_through_a_producer_restart(shards, tmp_path):
    """A training run whose standalone producer is killed (SIGKILL) after step 2 and started again on the
    same address: it reconnects and its losses equal those of an uninterrupted run."""
    from disttrain_core.config import REPO_ROOT

    from ..conftest import REPO, cli_overrides, read_metrics

    port = free_port()
    key = new_key()
    env = {**os.environ, "DISTTRAIN_PRODUCER_KEY": key, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}
    data = [f"data.path={shards}", "data.generate_if_missing=false"]
    common = [
        f"data.producer.address=127.0.0.1:{port}",
        "data.producer.timeout_s=60",
        "trainer.max_steps=8",
        "optim.global_batch_size=8",
        "optim.micro_batch_size=2",
        "trainer.checkpoint.every_n_steps=0",
    ]

    def producer(log):
        command = [sys.executable, "-m", "disttrain_core.launch.producer", "--listen", f"127.0.0.1:{port}", *data]
        return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def train(run_dir, kill_after=None):
        log = open(run_dir.parent / f"{run_dir.name}-producer.log", "w")  # noqa: SIM115  (closed below)
        servers = [producer(log)]
        trainer = subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), *cli_overrides(shards, run_dir), *common],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        output = []
        reader = threading.Thread(target=lambda: output.extend(trainer.stdout), daemon=True)
        reader.start()
        try:
            if kill_after is not None:
                metrics = run_dir / "metrics.jsonl"
                deadline = time.time() + 180
                while not (metrics.is_file() and len(read_metrics(run_dir)) >= kill_after):
                    assert trainer.poll() is None and time.time() < deadline, "".join(output)[-3000:]
                    time.sleep(0.05)
                servers[0].kill()
                servers[0].wait(timeout=10)
                servers.append(producer(log))
            trainer.wait(timeout=240)
            reader.join(timeout=10)
        finally:
            for process in (trainer, *servers):
                process.kill()
                process.wait(timeout=10)
            log.close()
        assert trainer.returncode == 0, "".join(output)[-3000:]
        return "".join(output), {m["step"]: m["loss"] for m in read_metrics(run_dir)}

    _, straight = train(tmp_path / "straight")
    output, restarted = train(tmp_path / "restarted", kill_after=2)
    assert "reconnected to the data producer" in output
    assert sorted(restarted) == sorted(straight) == list(range(1, 9))
    assert [restarted[s] for s in range(1, 9)] == pytest.approx([straight[s] for s in range(1, 9)], abs=1e-6)


def test_the_trainers_sample_costs_cross_the_hello_and_weigh_samples():
    """The producer does not know the model's FLOPs (data/ sits below models/): the trainers send them."""
    from types import SimpleNamespace

    from disttrain_core.data.producer_assembly import sample_costs
    from disttrain_core.data.producer_protocol import ProtocolError

    layout = replace(LAYOUT, costs=(3.0, 2.0, 1.0, 5.0, 7.0))
    assert Layout.from_dict(layout.to_dict()).costs == (3.0, 2.0, 1.0, 5.0, 7.0)
    for bad in (
        None,
        [1.0, 2.0, 3.0, 4.0],
        [1.0, float("nan"), 1.0, 1.0, 1.0],
        [1.0, -1.0, 1, 1, 1],
        ["1", 1, 1, 1, 1],
    ):
        with pytest.raises(ProtocolError, match="costs"):
            Layout.from_dict({**layout.to_dict(), "costs": bad})
    samples = [
        SimpleNamespace(images=[0, 0], gen_weight=1.0, audio=[], video=[]),
        SimpleNamespace(images=[], gen_weight=0.0, audio=[b"clip"], video=[(), ()]),  # per image/row/target/clip/group
    ]
    assert sample_costs(layout.costs, samples) == [2 * 3.0 + 2.0 + 1.0, 2.0 + 5.0 + 2 * 7.0]


def test_validation_with_a_producer_equals_validation_without(shards, val_shards, tmp_path):
    """The held-out split is read in the trainer, a producer feeding the training steps or not: the same
    held-out losses as a run without one (training through the producer is the same too)."""
    from ..conftest import cli_overrides, read_metrics, run_train

    common = ["trainer.max_steps=4", "optim.global_batch_size=8", "optim.micro_batch_size=2"]
    common += ["trainer.val_every_n_steps=2", "trainer.val_batches=2"]
    runs = {}
    for name, extra in (("producer", ["data.producer.workers=1"]), ("plain", [])):
        done = run_train(cli_overrides(shards, tmp_path / name) + common + extra)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = {m["step"]: (m["loss"], m.get("val/loss")) for m in read_metrics(tmp_path / name)}
    # the producer reorders a global batch's samples over the microbatches: sums in another order (~1e-7)
    assert sorted(runs["producer"]) == sorted(runs["plain"]) == [1, 2, 3, 4]
    for step, (loss, val) in runs["plain"].items():
        assert runs["producer"][step][0] == pytest.approx(loss, abs=1e-5)
        assert (val is None) == (step not in (2, 4))
        assert val is None or runs["producer"][step][1] == pytest.approx(val, abs=1e-5)
