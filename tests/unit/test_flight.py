"""The flight recorder (comm/flight.py): bounded records, what a dump holds, and tools/flight.py's
diagnosis of synthetic dumps (several process groups, transfers, a missing rank, a desynchronized group)."""

import importlib.util
import json
import os
import signal
import threading
import time
from collections import deque

import pytest

from disttrain_core.comm import flight
from disttrain_core.launch.cli import tool_main

from ..conftest import REPO


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    """A fresh recorder for the test; the module's state is put back afterwards."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")  # configure() only sets it when unset
    monkeypatch.setattr(flight, "_state", {"dir": None, "rank": None})
    monkeypatch.setattr(flight, "_records", deque(maxlen=2000))
    monkeypatch.setattr(flight, "_counts", {})
    monkeypatch.setattr(flight, "_reasons", [])
    return tmp_path


def _tool():
    spec = importlib.util.spec_from_file_location("flight_tool", REPO / "tools/flight.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_records_are_bounded_numbered_per_stream_and_cheap(recorder):
    flight.configure(recorder, 0, buffer_size=5)
    for _ in range(3):
        flight.record("send", group="7", peers=1, nbytes=4).completed()
        flight.record("recv", group="7", peers=[1], nbytes=4)
        flight.record("ring_all_gather", group="8", nbytes=64).started()
    kept = flight.records()
    assert len(kept) == 5 and [r["seq"] for r in kept] == list(range(5, 10))
    assert [(r["kind"], r["n"], r["state"]) for r in kept] == [
        ("recv", 2, "posted"),
        ("ring_all_gather", 2, "started"),
        ("send", 3, "completed"),
        ("recv", 3, "posted"),
        ("ring_all_gather", 3, "started"),
    ]
    assert kept[0]["peers"] == (1,) and kept[0]["thread"] == threading.current_thread().name
    start = time.perf_counter()
    for _ in range(10_000):
        flight.record("send", group="7", peers=1, nbytes=4).completed()
    assert (time.perf_counter() - start) / 10_000 < 50e-6  # ~2 us measured


def test_dump_holds_reasons_records_exception_and_every_threads_stack(recorder):
    assert flight.dump("not configured") is None
    flight.configure(recorder, 3)
    flight.record("send", group="7", peers=1, nbytes=4)
    release = threading.Event()
    helper = threading.Thread(target=release.wait, name="comm-stream-3")
    helper.start()
    try:
        try:
            raise RuntimeError("collective timed out")
        except RuntimeError as error:
            path = flight.dump(f"exception: {error}")
        assert path == recorder / "flight" / "rank3.json"
        assert flight.dump("signal SIGTERM") == path  # a second dump rewrites the file with both reasons
    finally:
        release.set()
        helper.join()
    document = json.loads(path.read_text())
    assert [r["reason"] for r in document["reasons"]] == ["exception: collective timed out", "signal SIGTERM"]
    assert document["rank"] == 3 and document["records"][0]["kind"] == "send"
    assert "RuntimeError: collective timed out" in document["exception"]["error"]
    assert document["exception"]["stack"][-1][2] == "test_dump_holds_reasons_records_exception_and_every_threads_stack"
    names = {t["name"]: t for t in document["threads"]}
    assert "comm-stream-3" in names and names["MainThread"]["main"]
    assert not any(frame[0] == flight.__file__ for t in document["threads"] for frame in t["stack"])
    assert "torch" in document and isinstance(document["torch"]["entries"], list)


def test_dump_from_a_signal_handler_names_the_interrupted_frame_and_never_raises(recorder):
    flight.configure(recorder, 0)
    dumped = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: dumped.append(flight.dump("signal SIGUSR1")))

    def waiting_here():
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)

    try:
        waiting_here()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    document = json.loads(dumped[0].read_text())
    assert document["where"][2] == "waiting_here"
    (recorder / "blocked").write_text("a file where the directory should be")
    flight.configure(recorder / "blocked", 0)
    assert flight.dump("cannot write") is None


def _dump(directory, rank, torch_entries=(), records=(), where=("train.py", 10, "step"), world=3, groups=None):
    groups = groups or {"0": {"ranks": [0, 1, 2], "desc": "default_pg"}, "1": {"ranks": [1, 2], "desc": "undefined"}}
    document = {
        "version": 1,
        "rank": rank,
        "world_size": world,
        "reasons": [{"reason": f"reason of {rank}", "time": 1_700_000_000_000_000_000}],
        "groups": groups,
        "torch": {"available": True, "entries": list(torch_entries)},
        "records": list(records),
        "threads": [{"name": "MainThread", "main": True, "stack": [list(where)]}],
        "where": list(where),
    }
    (directory / "flight").mkdir(exist_ok=True)
    (directory / "flight" / f"rank{rank}.json").write_text(json.dumps(document))


def _collectives(group, kinds, start=1, t0=0, done_upto=None):
    done_upto = start + len(kinds) - 1 if done_upto is None else done_upto
    return [
        {"group": group, "n": n, "kind": kind, "p2p": False, "state": "scheduled", "retired": n <= done_upto,
         "posted": 1_700_000_000_000_000_000 + (t0 + n) * 10**9}
        for n, kind in enumerate(kinds, start)
    ]  # fmt: skip


def _transfer(kind, n, peer, group="5", done=True):
    return {"seq": n, "kind": kind, "group": group, "peers": [peer], "nbytes": 4, "n": n, "thread": "MainThread",
            "state": "completed" if done else "posted", "posted": 1_700_000_000_000_000_000 + n * 10**9,
            "start": None, "end": None, "error": None}  # fmt: skip


def test_tool_names_the_first_divergence_across_groups_and_the_missing_rank(tmp_path, capsys):
    ops = ["all_reduce"] * 5 + ["broadcast", "all_reduce"]
    _dump(tmp_path, 0, _collectives("0", ops, done_upto=6))
    _dump(tmp_path, 1, _collectives("0", ops, done_upto=6) + _collectives("1", ["all_gather"] * 4, t0=20, done_upto=3))
    _dump(
        tmp_path, 2, _collectives("0", ops[:6]) + _collectives("1", ["all_gather"] * 3, t0=20), where=("x.py", 3, "f")
    )
    tool = _tool()
    assert tool_main(tool.main, [str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "flight recorder: dumps of ranks 0, 1, 2 (3 of 3)"
    assert lines[4].startswith(
        "rank 2 never entered all_reduce #7 (process group 0 'default_pg', ranks [0, 1, 2]) that ranks 0, 1 entered at"
    )
    assert "its last completed operation there was broadcast #6" in lines[4]
    assert lines[4].endswith("its main thread was in x.py:3 f")
    assert lines[6].startswith("  rank 2 never entered all_gather #4 (process group 1, ranks [1, 2]) that rank 1")

    _dump(tmp_path, 0, _collectives("0", ops, done_upto=6), world=4)  # a job of four ranks: rank 3 left no dump
    lines = tool.diagnose(tmp_path)
    assert "no dump from rank 3 (killed before it could write one?)" in lines


def test_tool_compares_transfers_and_finds_a_desynchronized_group(tmp_path):
    groups = {"0": {"ranks": [0, 1], "desc": "default_pg"}, "5": {"ranks": [0, 1], "desc": ""}}
    sends = [_transfer("send", n, 1) for n in (1, 2, 3)]
    _dump(tmp_path, 0, _collectives("0", ["all_reduce", "broadcast"]), sends, world=2, groups=groups)
    receives = [_transfer("recv", n, 0) for n in (1, 2)]
    _dump(tmp_path, 1, _collectives("0", ["all_reduce", "all_gather"]), receives, world=2, groups=groups)
    lines = _tool().diagnose(tmp_path)
    text = "\n".join(lines)
    assert "ranks disagree on operation #2 of process group 0 'default_pg', ranks [0, 1]:" in text
    assert "rank 0: broadcast; rank 1: all_gather" in text
    assert "rank 1 never posted receive #3 from rank 0 (process group 5) that rank 0 sent at" in text


def test_tool_exits_2_with_one_line_without_dumps(tmp_path, capsys):
    assert tool_main(_tool().main, [str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no flight recorder dumps" in err and "\n" not in err


def test_recording_keeps_no_reference_to_the_process_group(recorder, tmp_path):
    """A group kept alive by the recorder outlives destroy_process_group and is torn down during interpreter
    finalization, where gloo's threads abort the process ("terminate called without an active exception",
    seen once in ~10 runs of test_context_parallel before this was fixed)."""
    import gc
    import weakref
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        group = dist.new_group([0])
        name = flight.group_name(group)
        flight.record("send", group=group, peers=0, nbytes=4)
        alive = weakref.ref(group)
        dist.destroy_process_group(group)
        del group
        gc.collect()
        assert alive() is None, "the flight recorder still holds the process group"
        assert flight.group_name(name) == name  # names (str) pass through
    finally:
        dist.destroy_process_group()
