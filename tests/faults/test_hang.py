"""A rank that hangs: the others time out in the collective it never entered, every rank dumps its
flight recorder (comm/flight.py), and tools/flight.py names the hung rank and that collective.

The job is two gloo processes started from this file (``python test_hang.py <rank> <run dir>``): three
all-reduces on the default group and a ring all-gather on a second group (own records), then rank 1
sleeps where it should enter the fourth all-reduce. Rank 0 times out after ``TIMEOUT_S`` and dumps
from its exception handler; the test then sends rank 1 SIGTERM, whose handler dumps -- what the
launcher does to surviving ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 5
HUNG_RANK = 1


def _job(rank: int, run_dir: str) -> None:
    from datetime import timedelta

    from disttrain_core.comm import flight

    flight.configure(run_dir, rank)  # before the process group: torch reads TORCH_FR_BUFFER_SIZE then

    def on_sigterm(signum, frame):
        flight.dump("signal SIGTERM")
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    import torch
    import torch.distributed as dist

    from disttrain_core.comm.ring import RingCollectives

    store = dist.FileStore(os.path.join(run_dir, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=TIMEOUT_S))
    ring = RingCollectives(dist.new_group([0, 1], group_desc="ring"))
    tensor = torch.ones(8)
    for _ in range(3):
        dist.all_reduce(tensor)
    ring.all_gather(torch.empty(16), torch.ones(8), async_op=False)
    if rank == HUNG_RANK:
        time.sleep(120)  # the hang: never enters all_reduce #4
    try:
        dist.all_reduce(tensor)
    except Exception as error:
        flight.dump(f"exception: {error}")
        os._exit(1)
    os._exit(0)


def _leftovers(marker: str) -> list[int]:
    """Processes whose command line mentions ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.distributed
def test_flight_tool_names_the_hung_rank_and_the_collective_it_never_entered(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    started = time.monotonic()
    ranks = [
        subprocess.Popen([sys.executable, __file__, str(rank), str(run_dir)], env=env, cwd=REPO) for rank in (0, 1)
    ]
    try:
        assert ranks[0].wait(timeout=TIMEOUT_S + 25) == 1  # timed out in all_reduce #4, dumped, exited
        assert ranks[1].poll() is None  # still hung
        ranks[1].send_signal(signal.SIGTERM)
        assert ranks[1].wait(timeout=10) == 128 + signal.SIGTERM
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert time.monotonic() - started < TIMEOUT_S + 30
    assert _leftovers(str(run_dir)) == []

    assert sorted(p.name for p in (run_dir / "flight").glob("rank*.json")) == ["rank0.json", "rank1.json"]
    out = subprocess.run(
        [sys.executable, str(REPO / "tools/flight.py"), str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    diagnosis = out.stdout.splitlines()
    assert diagnosis[-1].startswith("rank 1 never entered all_reduce #4 (process group 0 'default_pg', ranks [0, 1])")
    assert "that rank 0 entered at" in diagnosis[-1]
    assert "its last completed operation there was all_reduce #3" in diagnosis[-1]
    assert "test_hang.py" in diagnosis[-1] and "_job" in diagnosis[-1]  # where rank 1's main thread was
    assert any("rank 0: exception:" in line for line in diagnosis)
    assert any("rank 1: signal SIGTERM" in line for line in diagnosis)

    # torch's own analyser reads the raw dumps (their process groups' members filled in for gloo)
    fr = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(run_dir / "flight" / "torch")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert "missing ranks: {1}" in fr.stdout + fr.stderr, fr.stdout + fr.stderr


if __name__ == "__main__":
    _job(int(sys.argv[1]), sys.argv[2])
