"""The producer transport against hostile peers: replay in both directions, allocation before
authentication, silent and slow clients, connection floods, and fuzzed frames."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disttrain_core.data import transport
from disttrain_core.data.batch import Batch
from disttrain_core.data.producer_protocol import Layout, decode_batch, encode_batch, parse_hello
from disttrain_core.data.transport import (
    BATCH,
    BYE,
    CLIENT,
    CONTROL_LIMIT,
    ERROR,
    GREETING,
    HEADER,
    HELLO,
    MAGIC,
    REQUEST,
    SERVER,
    VERSION,
    WELCOME,
    AuthenticationError,
    Channel,
    ProtocolError,
    client_channel,
    load_key,
    new_key,
    server_channel,
)

KEY = load_key(new_key())
LIMIT = 1 << 26
HUGE = 800 << 20  # the review's 800 MB frame


def pair(timeout: float = 5.0) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.settimeout(timeout)
    b.settimeout(timeout)
    return a, b


def tiny_batch() -> Batch:
    return Batch(
        tokens=torch.arange(16).reshape(2, 8),
        labels=torch.full((2, 8), -100),
        images=torch.zeros(1, 3, 4, 4, dtype=torch.uint8),
        image_counts=torch.tensor([1, 0]),
        gen_images=torch.zeros(2, 3, 4, 4, dtype=torch.uint8),
        gen_weight=torch.tensor([1.0, 0.0]),
        gen_noise=torch.zeros(2, 1, 2, 2),
        gen_timesteps=torch.tensor([3, 5]),
        keys=["a", "b"],
    )


HELLO_META = {
    "layout": {"slots": 1, "samples_per_slot": 2, "groups": 1, "stages": 1, "world": 1},
    "start": {"step": 0},
    "trainer": "t0",
    "job": {"trainer.seed": 1},
}


def client_session(sock: socket.socket) -> list[tuple[int, dict, bytes]]:
    channel = client_channel(sock, KEY, LIMIT, timeout=5.0)
    channel.send(HELLO, HELLO_META)
    got = [channel.recv()]
    channel.send(REQUEST, {"step": 1})
    got.append(channel.recv())
    channel.send(BYE, {})
    return got


def server_session(sock: socket.socket) -> list[tuple[int, dict, bytes]]:
    channel = server_channel(sock, KEY, CONTROL_LIMIT, time.monotonic() + 5)
    got = [channel.recv()]
    channel.send(WELCOME, {"step": 0})
    got.append(channel.recv())
    meta, payload = encode_batch(tiny_batch())
    channel.send(BATCH, {**meta, "step": 1}, payload)
    got.append(channel.recv())
    return got


def run_both(client_sock, server_sock):
    results, errors = {}, {}

    def side(name, fn, sock):
        try:
            results[name] = fn(sock)
        except Exception as error:  # noqa: BLE001  (reported by the caller)
            errors[name] = error

    threads = [
        threading.Thread(target=side, args=("client", client_session, client_sock)),
        threading.Thread(target=side, args=("server", server_session, server_sock)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    return results, errors


class Recorder:
    """A relay between a client and a server socket that keeps what each side sent."""

    def __init__(self, client_end: socket.socket, server_end: socket.socket):
        self.sent = {"client": bytearray(), "server": bytearray()}
        self.threads = [
            threading.Thread(target=self._copy, args=(client_end, server_end, "client"), daemon=True),
            threading.Thread(target=self._copy, args=(server_end, client_end, "server"), daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _copy(self, source, sink, name):
        try:
            while chunk := source.recv(65536):
                self.sent[name] += chunk
                sink.sendall(chunk)
        except OSError:
            pass


def test_handshake_and_replay_is_refused_in_both_directions():
    # A genuine session through a recording relay.
    client, relay_c = pair()
    relay_s, server = pair()
    recorder = Recorder(relay_c, relay_s)
    results, errors = run_both(client, server)
    assert not errors, errors
    kinds = [k for k, _, _ in results["client"]]
    assert kinds == [WELCOME, BATCH]
    assert decode_batch(results["client"][1][1], results["client"][1][2]).keys == ["a", "b"]
    assert [k for k, _, _ in results["server"]] == [HELLO, REQUEST, BYE]
    for sock in (client, server, relay_c, relay_s):
        sock.close()
    recorded_client, recorded_server = bytes(recorder.sent["client"]), bytes(recorder.sent["server"])
    assert len(recorded_client) > GREETING.size and len(recorded_server) > GREETING.size

    # Recorded client frames replayed to a new server connection: the server's fresh nonce breaks the tags.
    attacker, victim = pair()
    attacker.sendall(recorded_client)
    channel = server_channel(victim, KEY, CONTROL_LIMIT, time.monotonic() + 5)
    with pytest.raises(AuthenticationError):
        channel.recv()
    attacker.close(), victim.close()

    # Recorded server frames replayed to a new client: the client's fresh nonce breaks the tags.
    attacker, victim = pair()
    attacker.sendall(recorded_server)
    channel = client_channel(victim, KEY, LIMIT, timeout=5.0)
    channel.send(HELLO, HELLO_META)
    with pytest.raises(AuthenticationError):
        channel.recv()
    attacker.close(), victim.close()

    # A reflected greeting (the peer's own nonce and role sent back) is refused too.
    a, b = pair()
    b.sendall(GREETING.pack(MAGIC, VERSION, CLIENT, b"n" * 32))
    with mock.patch.object(transport, "_nonce", return_value=b"n" * 32), pytest.raises(ProtocolError):
        client_channel(a, KEY, LIMIT, timeout=5.0)
    a.close(), b.close()


def test_wrong_key_fails_authentication():
    client, server = pair()
    other = load_key(new_key())
    errors = {}

    def serve():
        try:
            server_channel(server, KEY, CONTROL_LIMIT, time.monotonic() + 5).recv()
        except Exception as error:  # noqa: BLE001
            errors["server"] = error

    thread = threading.Thread(target=serve)
    thread.start()
    client_channel(client, other, LIMIT, timeout=5.0).send(HELLO, HELLO_META)
    thread.join(timeout=10)
    assert isinstance(errors.get("server"), AuthenticationError)


def _attack(sock: socket.socket, greeting_role: bytes, kind: int, go: threading.Event, zeros: memoryview):
    """Greet, announce an 800 MB frame, then stream 200 MB of zeros (the review's attack)."""
    go.wait(10)
    try:
        sock.sendall(GREETING.pack(MAGIC, VERSION, greeting_role, b"x" * 32))
        sock.sendall(HEADER.pack(MAGIC, VERSION, kind, 0, HUGE))
        for _ in range(200):
            sock.sendall(zeros)
    except OSError:
        pass  # the victim hung up: what we want


@pytest.mark.parametrize("victim_side", ["server", "client"])
def test_unauthenticated_huge_frame_allocates_at_most_64kib(victim_side):
    """tracemalloc traces every Python allocation of this process, the victim's receive included; the
    attacker's 1 MiB buffer and thread exist before tracing starts, so the peak is the victim's."""
    victim, attacker = pair()
    zeros = memoryview(bytearray(1 << 20))
    go = threading.Event()
    role, kind = (CLIENT, HELLO) if victim_side == "server" else (SERVER, BATCH)
    thread = threading.Thread(target=_attack, args=(attacker, role, kind, go, zeros))
    thread.start()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        go.set()
        with pytest.raises(ProtocolError, match="exceeds the limit of 65536 before authentication"):
            if victim_side == "server":
                server_channel(victim, KEY, CONTROL_LIMIT, time.monotonic() + 5).recv()
            else:
                client_channel(victim, KEY, LIMIT, timeout=5.0).recv()  # before the server authenticated
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        victim.close()
        thread.join(timeout=10)
        attacker.close()
    print(f"{victim_side}: tracemalloc peak {peak} bytes during an unauthenticated 800 MB frame")
    assert peak < CONTROL_LIMIT


# ------------------------------------------------------------------------------- a live server
@pytest.fixture
def server_cfg():
    from disttrain_core.config import compose

    def make(*overrides):
        return compose(["trainer.accelerator=cpu", *overrides])

    return make


@pytest.fixture
def live_server(server_cfg):
    from disttrain_core.data.producer_server import ProducerServer

    servers = []

    def start(*overrides):
        server = ProducerServer(server_cfg(*overrides), KEY, "127.0.0.1:0")
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        host, _, port = server.address.rpartition(":")
        return server, (host, int(port))

    yield start
    for server in servers:
        server.close()


def closed_after(sock: socket.socket, limit: float) -> float:
    """Seconds until the peer closes ``sock`` (reading and discarding whatever comes)."""
    started = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def test_silent_and_slow_clients_are_dropped_at_the_handshake_deadline(live_server):
    server, address = live_server("data.producer.handshake_timeout_s=0.5")
    with socket.create_connection(address) as silent:
        assert len(silent.recv(GREETING.size, socket.MSG_WAITALL)) == GREETING.size
        waited = closed_after(silent, 5.0)
    assert 0.3 < waited < 2.0, waited

    # A slow drip of a valid greeting resets no timer: the deadline is for the whole handshake.
    def drip(sock):
        try:
            for byte in GREETING.pack(MAGIC, VERSION, CLIENT, b"y" * 32):  # one byte every 0.1 s: 3.9 s in all
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
        except OSError:
            pass

    with socket.create_connection(address) as slow:
        slow.recv(GREETING.size, socket.MSG_WAITALL)
        dripping = threading.Thread(target=drip, args=(slow,))
        dripping.start()
        waited = closed_after(slow, 5.0)
        dripping.join(timeout=10)
    assert 0.3 < waited < 2.0, waited
    assert server.rejected >= 2


def test_connections_beyond_the_cap_are_closed_at_once(live_server):
    server, address = live_server("data.producer.max_connections=3", "data.producer.handshake_timeout_s=30")
    threads_before = threading.active_count()
    held = [socket.create_connection(address) for _ in range(3)]
    for sock in held:
        assert len(sock.recv(GREETING.size, socket.MSG_WAITALL)) == GREETING.size
    extra = [socket.create_connection(address) for _ in range(20)]
    for sock in extra:  # closed without a greeting
        assert closed_after(sock, 5.0) < 2.0
        sock.close()
    assert server.refused == 20
    assert threading.active_count() <= threads_before + 3
    for sock in held:
        sock.close()
    deadline = time.monotonic() + 5
    while server.connections and time.monotonic() < deadline:
        time.sleep(0.02)
    with socket.create_connection(address) as again:  # room again
        assert len(again.recv(GREETING.size, socket.MSG_WAITALL)) == GREETING.size


def _status(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _bad_connection(address, index: int, zeros: bytes) -> None:
    with socket.create_connection(address, timeout=10) as sock:
        kind = index % 4
        if kind == 1:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 200)
        elif kind == 2:  # the review's attack, shortened: the producer hangs up after the header
            sock.sendall(GREETING.pack(MAGIC, VERSION, CLIENT, os.urandom(32)))
            sock.sendall(HEADER.pack(MAGIC, VERSION, HELLO, 0, HUGE))
            try:
                for _ in range(4):
                    sock.sendall(zeros)
            except OSError:
                pass
        elif kind == 3:  # a well-formed HELLO under another key
            channel = client_channel(sock, b"another key, 32 bytes long......", LIMIT, timeout=10)
            channel.send(HELLO, HELLO_META)
        # kind 0: connect and close at once
        try:
            sock.shutdown(socket.SHUT_WR)
            closed_after(sock, 10.0)
        except OSError:
            pass


def test_a_thousand_bad_connections_leave_a_standalone_producer_flat(tmp_path):
    """A real producer process (python -m disttrain_core.launch.producer): its VmRSS is everything it holds,
    threads and buffers included. 100 connections first warm it up (lazy imports, logging, the first thread
    stacks); then 1,000 more of four kinds may not add more than 5 MB or leave threads behind."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    key = new_key()
    empty = tmp_path / "empty"
    empty.mkdir()
    command = [sys.executable, "-m", "disttrain_core.launch.producer", "--listen", f"127.0.0.1:{port}"]
    command += [f"data.path={empty}", "data.generate_if_missing=true", "trainer.accelerator=cpu"]
    env = {**os.environ, "DISTTRAIN_PRODUCER_KEY": key}
    log = open(tmp_path / "producer.log", "w")  # noqa: SIM115  (closed below)
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (tmp_path / "producer.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the producer did not come up"
                time.sleep(0.2)
        address = ("127.0.0.1", port)
        zeros = bytes(1 << 20)
        for index in range(100):
            _bad_connection(address, index, zeros)
        time.sleep(0.5)
        rss_before, threads_before = _status(process.pid, "VmRSS"), _status(process.pid, "Threads")
        started = time.monotonic()
        # The review's attack in full: an 800 MB frame announced, 200 MB of zeros behind it.
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(GREETING.pack(MAGIC, VERSION, CLIENT, os.urandom(32)))
            sock.sendall(HEADER.pack(MAGIC, VERSION, HELLO, 0, HUGE))
            streamed = 0
            try:
                while streamed < 200 << 20:
                    streamed += sock.send(zeros)
            except OSError:
                pass
        assert streamed < 200 << 20  # the producer hung up after the header
        for index in range(1000):
            _bad_connection(address, index, zeros)
        elapsed = time.monotonic() - started
        time.sleep(0.5)
        rss_after, threads_after = _status(process.pid, "VmRSS"), _status(process.pid, "Threads")
        assert process.poll() is None
    finally:
        process.kill()
        process.wait(timeout=10)
        log.close()
    print(
        f"the 800 MB attack was cut after {streamed} bytes; 1000 bad connections in {elapsed:.1f} s: "
        f"VmRSS {rss_before} -> {rss_after} kB "
        f"({rss_after - rss_before:+d} kB), threads {threads_before} -> {threads_after}"
    )
    assert rss_after - rss_before < 5 * 1024
    assert threads_after <= threads_before


# ------------------------------------------------------------------------------- fuzzing
CLIENT_NONCE, SERVER_NONCE = b"c" * 32, b"s" * 32


class Tape:
    """A socket stand-in that keeps what is sent."""

    def __init__(self):
        self.data = bytearray()

    def sendall(self, data):
        self.data += bytes(data)

    def settimeout(self, _):
        pass


def _stream(side: bytes) -> tuple[bytes, list[int], list[tuple[int, dict, bytes]]]:
    """A genuine stream as received by ``side``: the peer's greeting, then its frames (and their offsets)."""
    tape = Tape()
    sender_side = SERVER if side == CLIENT else CLIENT
    sender = Channel(tape, KEY, CLIENT_NONCE, SERVER_NONCE, sender_side, LIMIT)
    nonce = SERVER_NONCE if sender_side == SERVER else CLIENT_NONCE
    tape.data += GREETING.pack(MAGIC, VERSION, sender_side, nonce)
    if side == SERVER:
        frames = [(HELLO, HELLO_META, b""), (REQUEST, {"step": 1}, b""), (BYE, {}, b"")]
    else:
        meta, payload = encode_batch(tiny_batch())
        frames = [(WELCOME, {"step": 0}, b""), (BATCH, {**meta, "step": 1}, payload), (ERROR, {"error": "x"}, b"")]
    offsets = []
    for kind, meta, payload in frames:
        offsets.append(len(tape.data))
        sender.send(kind, meta, payload)
    return bytes(tape.data), offsets, frames


STREAMS = {side: _stream(side) for side in (SERVER, CLIENT)}
FIELD_OFFSETS = {"magic": (0, 4), "version": (4, 2), "kind": (6, 2), "meta_len": (8, 4), "payload_len": (12, 8)}


@st.composite
def mutated_streams(draw):
    side = draw(st.sampled_from([SERVER, CLIENT]))
    data, offsets, frames = STREAMS[side]
    stream = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete", "header", "header", "splice"]))
        if not stream:
            break
        where = draw(st.integers(0, len(stream) - 1))
        if op == "flip":
            stream[where] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            stream[where] = draw(st.integers(0, 255))
        elif op == "truncate":
            del stream[where:]
        elif op == "insert":
            stream[where:where] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del stream[where : where + draw(st.integers(1, 64))]
        elif op == "splice":  # one genuine frame of the stream in another place
            index = draw(st.integers(0, len(offsets) - 1))
            end = offsets[index + 1] if index + 1 < len(offsets) else len(data)
            stream[where:where] = data[offsets[index] : end]
        else:  # a header field set to an arbitrary (often huge) value
            start, size = FIELD_OFFSETS[draw(st.sampled_from(sorted(FIELD_OFFSETS)))]
            at = draw(st.sampled_from(offsets)) + start
            value = draw(st.integers(0, (1 << (8 * size)) - 1))
            stream[at : at + size] = value.to_bytes(size, "big")
    return side, bytes(stream)


def test_fuzzed_frames_raise_protocol_or_connection_errors():
    """2,000 mutated streams (a greeting and three frames, 1-3 mutations each) fed to a receiving channel:
    every one ends in ProtocolError or ConnectionError (never another exception, never a hang: the stream
    ends, the socket has a timeout), and nothing but unmodified genuine frames is ever accepted."""
    counts = {"examples": 0, "protocol": 0, "closed": 0}

    @settings(
        max_examples=2000,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(mutated_streams())
    def feed(case):
        side, stream = case
        data, _, frames = STREAMS[side]
        counts["examples"] += 1
        receiver, writer = pair(timeout=2.0)
        try:
            writer.sendall(stream)
            writer.shutdown(socket.SHUT_WR)
            nonce = SERVER_NONCE if side == SERVER else CLIENT_NONCE
            accepted = 0
            with pytest.raises(ConnectionError) as raised:
                with mock.patch.object(transport, "_nonce", return_value=nonce):
                    channel = transport.open_channel(receiver, KEY, side, 1 << 20 if side == CLIENT else CONTROL_LIMIT)
                while True:
                    kind, meta, payload = channel.recv()
                    # only the genuine frames, in order, may get through
                    assert accepted < len(frames) and (kind, meta, bytes(payload)) == frames[accepted]
                    accepted += 1
            assert not isinstance(raised.value, TimeoutError)
            if stream == data:
                assert accepted == len(frames)
            counts["protocol" if isinstance(raised.value, ProtocolError) else "closed"] += 1
        finally:
            receiver.close()
            writer.close()

    feed()
    print(f"fuzz: {counts}")
    assert counts["examples"] >= 2000


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def tensor_tables():
    entry = st.fixed_dictionaries(
        {
            "name": st.sampled_from(["tokens", "labels", "images", "image_counts", "x"]) | json_values,
            "dtype": st.sampled_from(["uint8", "int64", "float32", "int32", "object"]) | json_values,
            "shape": st.lists(st.integers(-2, 1 << 40) | st.integers(0, 4), max_size=4) | json_values,
            "offset": st.integers(-2, 1 << 40) | st.integers(0, 64) | json_values,
        }
    )
    return st.lists(entry | json_values, max_size=6) | json_values


def test_authenticated_but_malformed_content_raises_protocol_errors():
    """What a key holder could send that the frame layer accepts: arbitrary HELLO contents and tensor
    tables must fail with ProtocolError (or parse into valid values), never another exception."""
    valid_hello = 0

    @settings(max_examples=600, deadline=None, derandomize=True, database=None)
    @given(
        st.dictionaries(
            st.sampled_from(["layout", "start", "trainer", "job", "block", "fields", "x"]), json_values, max_size=7
        ),
        st.fixed_dictionaries({"tensors": tensor_tables(), "keys": json_values}),
        st.binary(max_size=256),
    )
    def feed(hello, batch_meta, payload):
        nonlocal valid_hello
        try:
            layout, start, trainer, _, _, _ = parse_hello(hello)
            assert isinstance(layout, Layout) and isinstance(start["step"], int) and isinstance(trainer, str)
            valid_hello += 1
        except ProtocolError:
            pass
        try:
            batch = decode_batch(batch_meta, bytearray(payload))
            assert batch.size == len(batch.keys)
        except ProtocolError:
            pass

    feed()
    genuine = encode_batch(tiny_batch())
    assert decode_batch(genuine[0], bytearray(genuine[1])).keys == ["a", "b"]
    assert np.array_equal(decode_batch(genuine[0], bytearray(genuine[1])).tokens.numpy(), np.arange(16).reshape(2, 8))
