"""Flight recorder: what every rank was communicating when a job stopped.

Two recorders fill a rank's dump. torch's own (``TORCH_FR_BUFFER_SIZE``) keeps the
process groups' collectives -- on gloo in torch 2.13 too: one entry per
collective with its per-group sequence number, but no point-to-point transfers
and no started/completed states (``retired`` tells a finished entry from one in
flight). This module keeps what torch does not see: every transfer ``p2p.post``
starts (the pipeline broker's channels and the ring's exchanges) and every job of
a ``RingCollectives`` thread, each a small record in a fixed-size ring buffer
with a per-stream sequence number (``n``), its thread and its state.

``dump(reason)`` writes ``<run_dir>/flight/rank<R>.json`` (the reason, both
recorders' entries, the process groups' members, the exception being handled
and every thread's Python stack) and torch's raw dump, with the process groups'
members filled in, to ``<run_dir>/flight/torch/rank_<R>`` for
``python -m torch.distributed.flight_recorder.fr_trace``. ``tools/flight.py``
reads the JSON files and names the rank and operation where the ranks diverge
(docs/FLIGHT.md).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

FLIGHT_DIR = "flight"
VERSION = 1
P2P_KINDS = ("send", "recv")
MAX_FRAMES = 40

_state: dict = {"dir": None, "rank": None}
_records: deque = deque(maxlen=2000)
_reasons: list[dict] = []
_seq = itertools.count(1)
_counts: dict[tuple, int] = {}
_lock = threading.Lock()
_groups: dict[str, dict] = {}  # process group name -> {"ranks": global ranks, "desc": description}
_writes = itertools.count()


def configure(run_dir: str | Path, rank: int, buffer_size: int = 2000) -> None:
    """Enable torch's recorder (a value the user set wins) and dump into ``<run_dir>/flight`` as ``rank``.

    Call before the process group is created: torch reads its variables then. ``rank < 0`` (a launcher,
    before it starts the ranks): only torch's variables. A dump this rank left in the directory before (an
    earlier run or attempt, resumed there) moves to ``flight/previous/``, so the tool never reads it as this
    run's.
    """
    global _records
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(buffer_size))
    if rank < 0:
        return
    _state["dir"] = Path(run_dir) / FLIGHT_DIR
    _state["rank"] = int(rank)
    _retire_previous(_state["dir"], int(rank))
    if _records.maxlen != buffer_size:
        _records = deque(_records, maxlen=max(1, buffer_size))


def _retire_previous(directory: Path, rank: int) -> None:
    previous = directory / "previous"
    for path in (directory / f"rank{rank}.json", directory / "torch" / f"rank_{rank}"):
        try:
            if path.exists():
                previous.mkdir(parents=True, exist_ok=True)
                os.replace(path, previous / path.name)
        except OSError:
            pass


class Op:
    """One recorded transfer or ring job: ``started()`` and ``completed()`` stamp it (cheap, no device work)."""

    __slots__ = ("seq", "kind", "group", "peers", "nbytes", "n", "thread", "state", "posted", "start", "end", "error")

    def started(self) -> Op:
        self.state, self.start = "started", time.time_ns()
        return self

    def completed(self) -> Op:
        self.state, self.end = "completed", time.time_ns()
        return self

    def waited_on_stream(self) -> Op:
        """NCCL: ``wait()`` made the current CUDA stream wait for it; the host does not know it has finished."""
        self.state, self.end = "stream-waited", time.time_ns()
        return self

    def failed(self, error: BaseException) -> Op:
        self.state, self.end, self.error = "failed", time.time_ns(), f"{type(error).__name__}: {error}"[:300]
        return self

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


def group_name(group) -> str:
    """The process group's name, as torch's recorder files it (``None``: the default group); its members are
    remembered for the dump."""
    if isinstance(group, str):
        return group
    import torch.distributed as dist

    pg = dist.distributed_c10d._get_default_group() if group is None else group
    name = str(pg.group_name)
    if name not in _groups:  # no reference to the group is kept: it must die with destroy_process_group
        _groups[name] = {"ranks": dist.get_process_group_ranks(pg), "desc": getattr(pg, "group_desc", "")}
    return name


def record(kind: str, *, group, peers=(), nbytes: int = 0) -> Op:
    """Record an operation posted now: ``send``/``recv`` (one peer, global rank) or a collective-like job.

    Sequence numbers ``n`` count per stream: per (group, kind, peer) for a transfer, per group otherwise --
    the same stream on every rank of the group, which is what ``tools/flight.py`` compares.
    """
    op = Op()
    op.kind, op.group, op.nbytes = kind, group_name(group), int(nbytes)
    op.peers = (peers,) if isinstance(peers, int) else tuple(peers)
    key = (op.group, kind, op.peers[0] if op.peers else None) if kind in P2P_KINDS else (op.group,)
    with _lock:
        op.n = _counts[key] = _counts.get(key, 0) + 1
    op.seq = next(_seq)
    op.thread = threading.current_thread().name
    op.state, op.posted, op.start, op.end, op.error = "posted", time.time_ns(), None, None, None
    _records.append(op)
    return op


def records() -> list[dict]:
    """This process's records, oldest first."""
    return [op.as_dict() for op in list(_records)]


def reset() -> None:
    """Forget every record and counter (tests)."""
    _records.clear()
    _counts.clear()
    _reasons.clear()


def _handler_codes() -> set:
    codes = set()
    for number in signal.valid_signals():
        try:
            handler = signal.getsignal(number)
        except (ValueError, OSError):
            continue
        while isinstance(handler, functools.partial):
            handler = handler.func
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)
        if code is not None:
            codes.add(code)
    return codes


def _frames(frame) -> list:
    """Outermost first, without this module's frames; ``frame`` is the innermost."""
    here = __file__
    stack = []
    while frame is not None and len(stack) < MAX_FRAMES:
        if frame.f_code.co_filename != here:
            stack.append([frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name])
        frame = frame.f_back
    return stack[::-1]


def _threads() -> tuple[list[dict], list | None]:
    """Every thread's stack, and where the main thread was (before a signal handler interrupted it)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    handlers = _handler_codes()
    threads, where = [], None
    for ident, frame in sys._current_frames().items():
        threads.append({"name": names.get(ident, f"thread-{ident}"), "main": ident == main, "stack": _frames(frame)})
        if ident == main:
            inner = frame
            while frame is not None:  # the frame a signal handler interrupted, when one is running
                if frame.f_code in handlers and frame.f_back is not None:
                    inner = frame.f_back
                    break
                frame = frame.f_back
            stack = _frames(inner)
            where = stack[-1] if stack else None
    return threads, where


def _refresh_groups() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            for pg, name in list(dist.distributed_c10d._world.pg_names.items()):
                _groups.setdefault(
                    str(name), {"ranks": dist.get_process_group_ranks(pg), "desc": getattr(pg, "group_desc", "")}
                )
    except Exception:  # a torch without these internals: the members recorded so far
        pass


def _world_size() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
    except Exception:
        pass
    return int(os.environ.get("WORLD_SIZE", "0") or 0)


def _torch_entries(directory: Path, rank: int) -> dict:
    """torch's recorder: its entries (compact), and its raw dump written for ``fr_trace``."""
    try:
        from ..base.torch_compat import dump_flight_trace
    except ImportError:
        return {"available": False, "error": "this torch has no flight recorder", "entries": []}
    # Per-entry stack traces are left out: symbolizing 2000 of them took ~3 s here, too long for a signal handler.
    data = pickle.loads(dump_flight_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False))
    config = {k: v for k, v in (data.get("pg_config") or {}).items() if k}
    for name, group in _groups.items():  # gloo leaves pg_config empty: fr_trace needs the members
        config.setdefault(name, {"name": name, "desc": group["desc"], "ranks": str(list(group["ranks"]))})
    data["pg_config"] = config
    _write(directory / "torch" / f"rank_{rank}", pickle.dumps(data))
    entries = []
    for entry in data.get("entries", []):
        name, desc = (list(entry.get("process_group") or ("", "")) + ["", ""])[:2]
        entries.append(
            {
                "group": str(name),
                "desc": desc,
                "n": entry.get("collective_seq_id"),
                "p2p_n": entry.get("p2p_seq_id"),
                "p2p": bool(entry.get("is_p2p")),
                "kind": str(entry.get("profiling_name", "")).split(":", 1)[-1],
                "state": entry.get("state"),
                "retired": bool(entry.get("retired")),
                "posted": entry.get("time_created_ns"),
                "end": entry.get("time_discovered_completed_ns"),
                "sizes": entry.get("input_sizes"),
            }
        )
    return {"available": True, "error": None, "version": data.get("version"), "entries": entries}


def _write(path: Path, payload: bytes) -> None:
    """Whole or not at all: a dump interrupted by a second one never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{next(_writes)}")
    temporary.write_bytes(payload)
    os.replace(temporary, path)


def dump(reason: str) -> Path | None:
    """Write this rank's dump (again, with every reason so far, when called twice); never raises.

    Returns the JSON file, or ``None`` when ``configure`` was not called or writing failed.
    """
    try:
        directory, rank = _state["dir"], _state["rank"]
        if directory is None:
            return None
        _reasons.append({"reason": str(reason), "time": time.time_ns()})
        _refresh_groups()
        document: dict = {
            "version": VERSION,
            "rank": rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "world_size": _world_size(),
            "reasons": list(_reasons),
            "time": time.time_ns(),
        }
        error = sys.exc_info()[1]
        if error is not None:  # the exception being handled; a later dump (a signal) keeps it
            _state["exception"] = {
                "error": f"{type(error).__name__}: {error}"[:1000],
                "stack": [[f.filename, f.lineno, f.name] for f in traceback.extract_tb(error.__traceback__)],
            }
        if _state.get("exception"):
            document["exception"] = _state["exception"]
        try:
            document["torch"] = _torch_entries(directory, rank)
        except Exception as failure:
            document["torch"] = {"available": False, "error": f"{type(failure).__name__}: {failure}", "entries": []}
        document["groups"] = dict(_groups)
        document["records"] = records()
        document["threads"], document["where"] = _threads()
        path = directory / f"rank{rank}.json"
        _write(path, json.dumps(document, default=str).encode())
        return path
    except Exception:  # called from exception and signal handlers: a failed dump must not add a failure
        return None


def read_dumps(directory: str | Path) -> dict[int, dict]:
    """Every rank's JSON dump under ``directory`` (a run directory or its ``flight/``), by rank."""
    root = Path(directory)
    if (root / FLIGHT_DIR).is_dir():
        root = root / FLIGHT_DIR
    dumps = {}
    for path in sorted(root.glob("rank*.json")):
        try:
            document = json.loads(path.read_text())
            dumps[int(document["rank"])] = document
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return dumps
