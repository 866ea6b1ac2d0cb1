"""The producer <-> trainer wire format: framed, authenticated, no pickle.

A frame is

    magic "DTRF" | version u16 | kind u16 | meta length u32 | payload length u64 | meta (JSON) |
    payload (raw bytes) | HMAC-SHA256(key, session nonce + sequence number + everything before)

``meta`` is a small JSON object; tensors travel in ``payload`` as raw little-endian bytes that
``meta["tensors"]`` describes (name, dtype, shape, offset). Nothing received is ever
unpickled or evaluated. Every frame is authenticated with the shared key and bound to the
session (a random nonce the server sends first) and to its position in the session (a
sequence number per direction), so frames cannot be forged, replayed or reordered. A frame
whose header is malformed, whose sizes exceed the configured limit, or whose MAC is wrong
raises ``ProtocolError``; the server then drops that connection and keeps serving the others.

Handshake: the server sends ``HELLO_SERVER`` with a 32-byte nonce in the clear (not secret);
every later frame in both directions carries a MAC over the nonce, so a client without the
key cannot produce a single valid frame.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct

import numpy as np

MAGIC = b"DTRF"
VERSION = 1
HEADER = struct.Struct("!4sHHIQ")
MAC_BYTES = 32
NONCE_BYTES = 32

HELLO_SERVER, HELLO, REQUEST, BATCH, ERROR, BYE = 1, 2, 3, 4, 5, 6
KINDS = {HELLO_SERVER, HELLO, REQUEST, BATCH, ERROR, BYE}
DTYPES = {"uint8": np.uint8, "int64": np.int64, "float32": np.float32, "int32": np.int32}


# Directions keep the two MAC sequences apart (a server frame can't be reflected to the server).
TO_CLIENT, TO_SERVER = b"s>c", b"c>s"


class ProtocolError(ConnectionError):
    """A frame that is malformed, too large, or not authenticated."""


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


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    chunks = []
    while count:
        chunk = sock.recv(min(count, 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)


class Channel:
    """One authenticated connection (either side)."""

    def __init__(
        self, sock: socket.socket, key: bytes, nonce: bytes, max_frame_bytes: int, outgoing: bytes, incoming: bytes
    ):
        self.sock, self.key, self.nonce, self.limit = sock, key, nonce, max_frame_bytes
        self.outgoing, self.incoming = outgoing, incoming
        self.sent = 0
        self.received = 0

    def _mac(self, direction: bytes, sequence: int, body: bytes) -> bytes:
        return hmac.new(self.key, self.nonce + direction + struct.pack("!Q", sequence) + body, hashlib.sha256).digest()

    def send(self, kind: int, meta: dict, payload: bytes = b"") -> None:
        encoded = json.dumps(meta, separators=(",", ":")).encode()
        body = HEADER.pack(MAGIC, VERSION, kind, len(encoded), len(payload)) + encoded + payload
        self.sock.sendall(body + self._mac(self.outgoing, self.sent, body))
        self.sent += 1

    def recv(self) -> tuple[int, dict, bytes]:
        header = _recv_exact(self.sock, HEADER.size)
        magic, version, kind, meta_len, payload_len = HEADER.unpack(header)
        if magic != MAGIC:
            raise ProtocolError("not a disttrain frame (bad magic)")
        if version != VERSION:
            raise ProtocolError(f"protocol version {version}, expected {VERSION}")
        if kind not in KINDS:
            raise ProtocolError(f"unknown frame kind {kind}")
        if meta_len > 1 << 20 or meta_len + payload_len > self.limit:
            raise ProtocolError(f"frame of {meta_len + payload_len} bytes exceeds the limit of {self.limit}")
        rest = _recv_exact(self.sock, meta_len + payload_len + MAC_BYTES)
        body = header + rest[:-MAC_BYTES]
        if not hmac.compare_digest(rest[-MAC_BYTES:], self._mac(self.incoming, self.received, body)):
            raise ProtocolError("authentication failed: wrong key, or a forged or replayed frame")
        self.received += 1
        try:
            meta = json.loads(rest[:meta_len])
        except ValueError as error:
            raise ProtocolError(f"malformed frame metadata: {error}") from error
        if not isinstance(meta, dict):
            raise ProtocolError("frame metadata is not an object")
        return kind, meta, rest[meta_len:-MAC_BYTES]


def server_channel(sock: socket.socket, key: bytes, max_frame_bytes: int) -> Channel:
    nonce = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + struct.pack("!H", VERSION) + nonce)
    return Channel(sock, key, nonce, max_frame_bytes, TO_CLIENT, TO_SERVER)


def client_channel(sock: socket.socket, key: bytes, max_frame_bytes: int) -> Channel:
    greeting = _recv_exact(sock, len(MAGIC) + 2 + NONCE_BYTES)
    if greeting[:4] != MAGIC or struct.unpack("!H", greeting[4:6])[0] != VERSION:
        raise ProtocolError("the server does not speak this protocol version")
    return Channel(sock, key, greeting[6:], max_frame_bytes, TO_SERVER, TO_CLIENT)


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


def unpack_arrays(described: list, payload: bytes) -> dict[str, np.ndarray]:
    arrays = {}
    if not isinstance(described, list):
        raise ProtocolError("tensor table is not a list")
    for entry in described:
        try:
            dtype = np.dtype(DTYPES[entry["dtype"]]).newbyteorder("<")
            shape = tuple(int(d) for d in entry["shape"])
            offset = int(entry["offset"])
            if any(d < 0 for d in shape) or offset < 0:
                raise ValueError("negative size")
            count = int(np.prod(shape, dtype=np.int64))
            end = offset + count * dtype.itemsize
            if end > len(payload):
                raise ValueError("tensor runs past the payload")
            arrays[str(entry["name"])] = (
                np.frombuffer(payload, dtype=dtype, count=count, offset=offset)
                .reshape(shape)
                .astype(dtype.newbyteorder("="))
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ProtocolError(f"bad tensor description {entry!r}: {error}") from error
    return arrays
