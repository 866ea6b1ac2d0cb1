"""Live recovery's wire: a healthy replica group sends its state to a joining one, authenticated, never pickled.

torchft's own transports do not meet this project's rules: ``HTTPTransport`` serves on every interface with no
authentication and loads what it receives with ``torch.load(weights_only=False)``; ``PGTransport`` pickles its
metadata. This one implements torchft's ``CheckpointTransport`` over the data producer's framed channel
(data/transport.py: both sides' nonces, HMAC-SHA256 over every frame with the job's key, a domain of its own):

* the state is a tree of dicts and lists whose leaves are tensors, numbers, strings, booleans or None; the tree
  travels as JSON (a tensor leaf names its entry), the tensors as one safetensors buffer;
* ``send_checkpoint`` serializes the state at once (a snapshot: training may change the live tensors after it) and
  serves it to whoever asks for that step until ``disallow_checkpoint``;
* ``recv_checkpoint`` asks the source's server (its address is the source's ``metadata()``) for the step.

Each rank of a replica group runs one server: rank r of a joining group receives from rank r of a healthy one
(torchft pairs them), so sharded state (FSDP2 within a group) travels shard by shard.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from datetime import timedelta

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torchft.checkpointing.transport import CheckpointTransport

from ...base.dtensor import local
from ...data.transport import BATCH, ERROR, REQUEST, WELCOME, ProtocolError, client_channel, server_channel

log = logging.getLogger(__name__)
DOMAIN = b"disttrain-heal/1"
TENSOR, FLOAT = "__tensor__", "__float__"
STATE_LIMIT = 1 << 40  # bytes of one state after the peer authenticated (1 TiB: a rank's shard of any model here)


def encode(tree) -> tuple[object, dict[str, torch.Tensor]]:
    """(JSON-able tree, tensors by entry name): tensors are copied to the host (a snapshot)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node):
        if hasattr(node, "local_shards"):  # a ShardedTensor (ZeRO-1's master chunks): this rank's pieces, in order
            return [walk(shard.tensor) for shard in node.local_shards()]
        if isinstance(node, torch.Tensor):
            name = str(len(tensors))
            tensors[name] = local(node).detach().to("cpu", copy=True).contiguous()  # a DTensor: this rank's shard
            return {TENSOR: name}
        if isinstance(node, dict):
            if not all(isinstance(key, str) for key in node):
                raise TypeError(f"state keys must be strings, got {sorted(map(repr, node))[:3]}")
            if TENSOR in node or FLOAT in node:
                raise TypeError(f"a state dict may not use the reserved key {TENSOR!r} or {FLOAT!r}")
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, (list, tuple)):
            return [walk(value) for value in node]
        if isinstance(node, float) and not math.isfinite(node):
            return {FLOAT: repr(node)}
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"cannot send a {type(node).__name__} in a replica's state (tensors, numbers, text only)")

    return walk(tree), tensors


def decode(tree, tensors: dict[str, torch.Tensor]):
    def walk(node):
        if isinstance(node, dict):
            if set(node) == {TENSOR}:
                if node[TENSOR] not in tensors:
                    raise ProtocolError(f"the state names tensor {node[TENSOR]!r}, which it does not carry")
                return tensors[node[TENSOR]]
            if set(node) == {FLOAT}:
                if node[FLOAT] not in ("inf", "-inf", "nan"):
                    raise ProtocolError(f"bad float {node[FLOAT]!r}")
                return float(node[FLOAT])
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(value) for value in node]
        return node

    return walk(tree)


class HealTransport(CheckpointTransport[dict]):
    """torchft's checkpoint transport for live recovery (module docstring). ``bind``: the host to listen on;
    ``advertise``: the host peers reach it by (the bind host unless it is a wildcard)."""

    def __init__(self, key: bytes, bind: str = "127.0.0.1", advertise: str | None = None, timeout: float = 60.0):
        self.key, self.timeout = key, timeout
        self._listener = socket.create_server((bind, 0), backlog=16)
        self.port = self._listener.getsockname()[1]
        self.host = advertise or bind
        self._lock = threading.Condition()
        self._snapshot: tuple[int, bytes, bytes] | None = None  # (step, JSON tree, safetensors bytes)
        self._closed = False
        self._withdrawn = -1  # the newest step whose snapshot was withdrawn: a request for it is refused at once
        self.sent = 0  # states served (a healthy peer's count)
        threading.Thread(target=self._serve, name="disttrain-heal-server", daemon=True).start()

    # ------------------------------------------------------------------ torchft's interface
    def metadata(self) -> str:
        return f"{self.host}:{self.port}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict, timeout: timedelta) -> None:
        import json

        tree, tensors = encode(state_dict)
        payload = save_tensors(tensors) if tensors else b""
        meta = json.dumps({"step": step, "tree": tree}, allow_nan=False).encode()
        with self._lock:
            self._snapshot = (step, meta, payload)
            self._lock.notify_all()
        if dst_ranks:  # (none: a local-SGD worker's copy for its ring neighbour, every sync: workers.py)
            log.info("serving step %d's state (%.1f MB) to joining replica(s) %s", step, len(payload) / 1e6, dst_ranks)

    def disallow_checkpoint(self) -> None:
        with self._lock:
            if self._snapshot is not None:
                self._withdrawn = max(self._withdrawn, self._snapshot[0])
            self._snapshot = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict:
        import json

        host, port = metadata.rsplit(":", 1)
        seconds = timeout.total_seconds()
        deadline = time.monotonic() + seconds
        with socket.create_connection((host.strip("[]"), int(port)), timeout=seconds) as sock:
            channel = client_channel(sock, self.key, STATE_LIMIT, timeout=seconds, deadline=deadline, domain=DOMAIN)
            channel.send(REQUEST, {"step": step})
            kind, meta, payload = channel.recv()  # a small frame first: large ones only from an authenticated peer
            if kind == WELCOME:
                kind, meta, payload = channel.recv()
        if kind == ERROR:
            raise RuntimeError(f"replica {src_rank} could not send step {step}'s state: {meta.get('message')}")
        if kind != BATCH or "state" not in meta:
            raise ProtocolError(f"unexpected reply (frame kind {kind}) to a state request")
        body = json.loads(meta["state"])
        if body.get("step") != step:
            raise ProtocolError(f"asked for step {step}'s state, got step {body.get('step')}'s")
        tensors = load_tensors(bytes(payload)) if payload else {}
        return decode(body["tree"], tensors)

    def shutdown(self, wait: bool = True) -> None:
        self._closed = True
        with self._lock:
            self._snapshot = None
            self._lock.notify_all()
        self._listener.close()

    # ------------------------------------------------------------------ the server
    def _serve(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(sock,), name="disttrain-heal-send", daemon=True).start()

    def _answer(self, sock: socket.socket) -> None:
        deadline = time.monotonic() + self.timeout
        with sock:
            try:
                channel = server_channel(sock, self.key, deadline=deadline, domain=DOMAIN)
                kind, meta, _ = channel.recv()
                step = meta.get("step")
                if kind != REQUEST or not isinstance(step, int):
                    raise ProtocolError("expected a state request naming a step")
                snapshot = self._wait_for(step, deadline)
                if snapshot is None:
                    channel.send(ERROR, {"message": f"no state of step {step} to send (not asked to, or withdrawn)"})
                    return
                self.sent += 1
                channel.send(WELCOME, {})
                channel.send(BATCH, {"state": snapshot[1].decode()}, snapshot[2])
            except (OSError, ProtocolError, TimeoutError, ValueError) as error:
                log.warning("a state request failed: %s", error)

    def _wait_for(self, step: int, deadline: float):
        """The snapshot of ``step`` once ``send_checkpoint`` made it (a joiner may ask first)."""
        with self._lock:
            while not self._closed and step > self._withdrawn:
                if self._snapshot is not None and self._snapshot[0] == step:
                    return self._snapshot
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._lock.wait(min(remaining, 0.5))
        return None
