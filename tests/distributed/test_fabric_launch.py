"""trainer.start_method=forkserver: ranks forked from a server that preloaded torch and this package,
each seeing the environment of its own launch (not the server's, which is as old as its first job)."""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

from disttrain_core.launch.fabric import PRELOAD, ddp_strategy


def _report(fabric, out: str) -> None:
    seen = {
        "probe": os.environ.get("DISTTRAIN_TEST_PROBE", ""),
        "preloaded": PRELOAD in sys.modules,
        "world": fabric.world_size,
        "pid": os.getpid(),
    }
    Path(out, f"rank{fabric.global_rank}.txt").write_text(json.dumps(seen))
    # rank 0 hosts the rendezvous store: leaving before the others finish joining resets their connection to it
    # (gloo's rendezvous reads the store after rank 0 is through), as no real job, which runs a collective, does
    fabric.barrier()


def _launch(start_method: str, out: Path) -> list[dict]:
    from lightning_fabric import Fabric
    from lightning_fabric.plugins.environments import LightningEnvironment

    out.mkdir()
    strategy = ddp_strategy(
        start_method,
        process_group_backend="gloo",
        timeout=timedelta(seconds=60),
        cluster_environment=LightningEnvironment(),
    )
    Fabric(accelerator="cpu", devices=2, strategy=strategy).launch(_report, str(out))
    return [json.loads(out.joinpath(f"rank{r}.txt").read_text()) for r in range(2)]


def test_forkserver_ranks_see_each_launch_environment_and_the_preload(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTTRAIN_TEST_PROBE", "first")
    first = _launch("forkserver", tmp_path / "a")
    monkeypatch.setenv("DISTTRAIN_TEST_PROBE", "second")
    monkeypatch.delenv("MASTER_PORT")  # the first launch's (Fabric exports it): a fresh one, as a new job picks
    second = _launch("forkserver", tmp_path / "b")
    assert [r["probe"] for r in first] == ["first", "first"]
    assert [r["probe"] for r in second] == ["second", "second"]
    assert all(r["preloaded"] and r["world"] == 2 for r in first + second)
    assert {r["pid"] for r in first}.isdisjoint(r["pid"] for r in second)


def test_spawn_ranks_are_fresh_interpreters(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTTRAIN_TEST_PROBE", "spawned")
    ranks = _launch("spawn", tmp_path / "s")
    assert [r["probe"] for r in ranks] == ["spawned", "spawned"]
    assert not any(r["preloaded"] for r in ranks)
