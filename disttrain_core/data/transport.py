"""The producer <-> trainer wire format: framed, authenticated, no pickle.

Connection (protocol version 2)::

    both sides, at once:  greeting = magic "DTRF" | version u16 | role "C"/"S" | 32-byte random nonce
    then frames:          magic "DTRF" | version u16 | kind u16 | meta length u32 | payload length u64 |
                          meta (JSON) | payload (raw bytes) | HMAC-SHA256 tag

The tag is HMAC-SHA256(key, domain | client nonce | server nonce | direction | sequence number |
header | meta | payload). Both sides contribute a fresh nonce, so a frame recorded on one
connection fails on any other, whichever side the recording is replayed to; the direction and
the per-direction sequence number stop reflection, reordering and replay within a connection.

Memory before authentication is bounded: a frame's sizes are checked from its 20-byte header,
before its body is read, against ``CONTROL_LIMIT`` (64 KiB) until the peer has sent one frame
whose tag verifies, and against the channel's own limit after that. The producer receives only
small control frames from trainers, so it keeps the 64 KiB limit for the whole connection. A
deadline (absolute, not per read) bounds how long a peer may take; a greeting or frame that is
malformed, too large, or not authenticated raises ``ProtocolError`` (``AuthenticationError``
when the tag is wrong), and the producer drops that connection and keeps serving the others.

``meta`` is a small JSON object; tensors travel in ``payload`` as raw little-endian bytes that
``meta["tensors"]`` describes (name, dtype, shape, offset). Nothing received is ever
unpickled or evaluated.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import time

import numpy as np

MAGIC = b"DTRF"
VERSION = 2
HEADER = struct.Struct("!4sHHIQ")
GREETING = struct.Struct("!4sHc32s")
MAC_BYTES = 32
NONCE_BYTES = 32
CONTROL_LIMIT = 64 << 10  # largest frame accepted before the peer has authenticated (and from any trainer)
META_LIMIT = 1 << 20  # largest JSON metadata of any frame
DOMAIN = b"disttrain-producer/2"

HELLO, WELCOME, REQUEST, BATCH, ERROR, BYE = 1, 2, 3, 4, 5, 6
KINDS = {HELLO, WELCOME, REQUEST, BATCH, ERROR, BYE}
DTYPES = {"uint8": np.uint8, "int64": np.int64, "float32": np.float32, "int32": np.int32}

CLIENT, SERVER = b"C", b"S"
# Directions keep the two MAC sequences apart (a server frame can't be reflected to the server).
TO_CLIENT, TO_SERVER = b"s>c", b"c>s"


class ProtocolError(ConnectionError):
    """A greeting or frame that is malformed, too large, or not authenticated."""


class AuthenticationError(ProtocolError):
    """A frame whose tag does not verify: another key, or a forged or replayed frame."""


def load_key(value: str) -> bytes:
    """A shared key: ``hex:<hex>``, ``file:<path>``, or the text itself (at least 16 bytes)."""
    if value.startswith("file:"):
        with open(value[5:], "rb") as handle:
            key = handle.read().strip()
    elif value.startswith("hex:"):
        key = bytes.fromhex(value[4:])
    else:
        key = value.encode()
    if len(key) < 16:
        raise ValueError("the producer key must be at least 16 bytes (use e.g. hex:$(openssl rand -hex 32))")
    return key


def new_key() -> str:
    return "hex:" + os.urandom(32).hex()


class Channel:
    """One authenticated connection (either side), after the greetings.

    ``timeout`` bounds each socket operation, ``deadline`` (``time.monotonic()`` seconds) the
    whole remaining exchange; either may be None. Received payloads are ``bytearray``s.
    """

    def __init__(
        self,
        sock: socket.socket,
        key: bytes,
        client_nonce: bytes,
        server_nonce: bytes,
        side: bytes,
        limit: int,
        timeout: float | None = None,
        deadline: float | None = None,
    ):
        self.sock, self.key, self.limit = sock, key, int(limit)
        self.prefix = DOMAIN + client_nonce + server_nonce
        self.outgoing, self.incoming = (TO_SERVER, TO_CLIENT) if side == CLIENT else (TO_CLIENT, TO_SERVER)
        self.timeout, self.deadline = timeout, deadline
        self.sent = 0
        self.received = 0
        self.bytes_received = 0  # every byte of every frame read, header and MAC included
        self.peer_authenticated = False

    # ------------------------------------------------------------------ socket I/O with deadlines
    def _arm(self) -> None:
        timeout = self.timeout
        if self.deadline is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the peer did not finish in time")
            timeout = remaining if timeout is None else min(timeout, remaining)
        self.sock.settimeout(timeout)

    def _read(self, count: int) -> bytearray:
        return read_exact(self.sock, count, self._arm)

    def _write(self, data) -> None:
        self._arm()
        self.sock.sendall(data)

    def _tag(self, direction: bytes, sequence: int):
        return hmac.new(self.key, self.prefix + direction + struct.pack("!Q", sequence), hashlib.sha256)

    # ------------------------------------------------------------------ frames
    def frame_limit(self) -> int:
        return self.limit if self.peer_authenticated else min(self.limit, CONTROL_LIMIT)

    def send(self, kind: int, meta: dict, payload=b"") -> None:
        encoded = json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()
        header = HEADER.pack(MAGIC, VERSION, kind, len(encoded), len(payload))
        tag = self._tag(self.outgoing, self.sent)
        for part in (header, encoded, payload):
            tag.update(part)
        if len(payload) <= CONTROL_LIMIT:
            self._write(b"".join((header, encoded, bytes(payload), tag.digest())))
        else:  # no copy of a large payload
            self._write(header + encoded)
            self._write(payload)
            self._write(tag.digest())
        self.sent += 1

    def recv(self) -> tuple[int, dict, bytearray]:
        header = bytes(self._read(HEADER.size))
        magic, version, kind, meta_len, payload_len = HEADER.unpack(header)
        if magic != MAGIC:
            raise ProtocolError("not a disttrain frame (bad magic)")
        if version != VERSION:
            raise ProtocolError(f"protocol version {version}, expected {VERSION}")
        if kind not in KINDS:
            raise ProtocolError(f"unknown frame kind {kind}")
        limit = self.frame_limit()
        if meta_len > META_LIMIT or meta_len + payload_len > limit:  # from the header, before reading the body
            state = "" if self.peer_authenticated else " before authentication"
            raise ProtocolError(f"frame of {meta_len + payload_len} bytes exceeds the limit of {limit}{state}")
        tag = self._tag(self.incoming, self.received)
        tag.update(header)
        meta_raw = self._read(meta_len)
        tag.update(meta_raw)
        payload = self._read(payload_len)
        tag.update(payload)
        if not hmac.compare_digest(bytes(self._read(MAC_BYTES)), tag.digest()):
            raise AuthenticationError("authentication failed: another key, or a forged or replayed frame")
        self.received += 1
        self.bytes_received += HEADER.size + meta_len + payload_len + MAC_BYTES
        self.peer_authenticated = True
        try:
            meta = json.loads(meta_raw)
        except ValueError as error:  # UnicodeDecodeError and JSONDecodeError included
            raise ProtocolError(f"malformed frame metadata: {error}") from error
        if not isinstance(meta, dict):
            raise ProtocolError("frame metadata is not an object")
        return kind, meta, payload


def read_exact(sock: socket.socket, count: int, arm=None) -> bytearray:
    """Exactly ``count`` bytes (``arm`` is called before every read, to set the timeout)."""
    buffer = bytearray(count)
    view = memoryview(buffer)
    done = 0
    while done < count:
        if arm is not None:
            arm()
        got = sock.recv_into(view[done:], min(count - done, 1 << 20))
        if not got:
            raise ConnectionError("the peer closed the connection")
        done += got
    return buffer


def _nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def open_channel(
    sock: socket.socket,
    key: bytes,
    side: bytes,
    limit: int,
    timeout: float | None = None,
    deadline: float | None = None,
    domain: bytes = DOMAIN,
) -> Channel:
    """Exchange greetings (each side sends its nonce at once) and return the channel. ``domain`` keeps the
    tags of one service's frames apart from another's (a producer frame never verifies as a checkpoint's)."""
    nonce = _nonce()
    channel = Channel(sock, key, b"", b"", side, limit, timeout, deadline)
    channel._write(GREETING.pack(MAGIC, VERSION, side, nonce))
    magic, version, role, peer_nonce = GREETING.unpack(bytes(channel._read(GREETING.size)))
    if magic != MAGIC:
        raise ProtocolError("the peer does not speak the disttrain producer protocol (bad magic)")
    if version != VERSION:
        raise ProtocolError(f"the peer speaks protocol version {version}, this side {VERSION}: update one of them")
    expected = SERVER if side == CLIENT else CLIENT
    if role != expected or peer_nonce == nonce:
        raise ProtocolError("the peer's greeting is not one of its own (reflected or wrong role)")
    client_nonce, server_nonce = (nonce, peer_nonce) if side == CLIENT else (peer_nonce, nonce)
    channel.prefix = domain + client_nonce + server_nonce
    return channel


def server_channel(
    sock: socket.socket,
    key: bytes,
    limit: int = CONTROL_LIMIT,
    deadline: float | None = None,
    domain: bytes = DOMAIN,
):
    return open_channel(sock, key, SERVER, limit, deadline=deadline, domain=domain)


def client_channel(
    sock: socket.socket,
    key: bytes,
    limit: int,
    timeout: float | None = None,
    deadline: float | None = None,
    domain: bytes = DOMAIN,
) -> Channel:
    return open_channel(sock, key, CLIENT, limit, timeout=timeout, deadline=deadline, domain=domain)


def pack_arrays(arrays: dict[str, np.ndarray]) -> tuple[list[dict], bytes]:
    described, parts, offset = [], [], 0
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        dtype = array.dtype.name
        if dtype not in DTYPES:
            raise ValueError(f"cannot send dtype {dtype}")
        raw = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        described.append({"name": name, "dtype": dtype, "shape": list(array.shape), "offset": offset})
        parts.append(raw)
        offset += len(raw)
    return described, b"".join(parts)


def _count(shape) -> int:
    if not isinstance(shape, list) or len(shape) > 8:
        raise ValueError("shape is not a list of at most 8 sizes")
    count = 1
    for size in shape:
        if type(size) is not int or size < 0:
            raise ValueError(f"size {size!r} is not a non-negative integer")
        count *= size
    return count


def unpack_arrays(described, payload) -> dict[str, np.ndarray]:
    """The arrays a tensor table describes; ``ProtocolError`` for any inconsistency."""
    if not isinstance(described, list):
        raise ProtocolError("tensor table is not a list")
    arrays = {}
    for entry in described:
        try:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise ValueError("not an object with a name")
            dtype = np.dtype(DTYPES[entry["dtype"]]).newbyteorder("<")
            shape = entry["shape"]
            count = _count(shape)
            offset = entry["offset"]
            if type(offset) is not int or offset < 0:
                raise ValueError("bad offset")
            if offset + count * dtype.itemsize > len(payload):
                raise ValueError("tensor runs past the payload")
            arrays[entry["name"]] = (
                np.frombuffer(payload, dtype=dtype, count=count, offset=offset)
                .reshape(shape)
                .astype(dtype.newbyteorder("="))
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ProtocolError(f"bad tensor description {str(entry)[:200]}: {error}") from error
    return arrays
