"""The emulated multi-node harness (tools/netem_cluster.py): it cleans up after itself, and
train.py runs across two emulated nodes with the losses of one node."""

import ast
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from ..conftest import REPO, cli_overrides, read_metrics, run_train

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
        reason="the emulated cluster needs root and iproute2 (ip, tc)",
    ),
]
TOOL = [sys.executable, str(REPO / "tools" / "netem_cluster.py")]


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("dtn")}


def links() -> int:
    return len(subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines())


def test_nodes_see_each_other_and_everything_is_removed_on_success_and_failure(tmp_path):
    before, root_links = namespaces(), links()
    # Each node writes its own file: the nodes share one stdout pipe, and under PYTHONUNBUFFERED
    # their prints interleave piece by piece (CI saw "10 10.77.110.1 \n10.77.110.1").
    probe = (
        "import os, socket, sys; s = socket.socket(); "
        "s.bind((os.environ['MASTER_ADDR'], 0)) if os.environ['NODE_RANK'] == '0' else None; "
        "open(os.path.join(sys.argv[1], 'node' + os.environ['NODE_RANK']), 'w')"
        ".write(os.environ['MASTER_ADDR'])"
    )
    ok = subprocess.run(
        [*TOOL, "nodes=2", "--", sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    seen = {path.name: path.read_text() for path in tmp_path.iterdir()}
    assert sorted(seen) == ["node0", "node1"]  # both nodes ran
    assert seen["node0"] == seen["node1"] and seen["node0"].startswith("10.77.")  # one master address
    failed = subprocess.run([*TOOL, "nodes=2", "--", "sh", "-c", "exit 3"], capture_output=True, text=True)
    assert failed.returncode == 3
    assert namespaces() == before and links() == root_links


def test_pinned_nodes_run_on_their_own_core_with_their_own_rate(tmp_path):
    """pin=true: node k's processes may use core k only; rate=a,b: node k's egress is shaped at its own rate."""
    probe = (
        "import os, subprocess, sys; k = os.environ['NODE_RANK']; "
        "qdisc = subprocess.run(['tc', 'qdisc', 'show', 'dev', 'eth0'], capture_output=True, text=True).stdout; "
        "open(os.path.join(sys.argv[1], 'node' + k), 'w').write(repr((sorted(os.sched_getaffinity(0)), qdisc)))"
    )
    ok = subprocess.run(
        [*TOOL, "nodes=2", "pin=true", "rate=1gbit,100mbit", "--", sys.executable, "-c", probe, str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    cores = sorted(os.sched_getaffinity(0))
    for k, rate in enumerate(("1Gbit", "100Mbit")):
        affinity, qdisc = ast.literal_eval((tmp_path / f"node{k}").read_text())
        assert affinity == [cores[k % len(cores)]]
        assert f"rate {rate}" in qdisc, qdisc
    bad = subprocess.run([*TOOL, "nodes=2", "rate=1gbit,2gbit,3gbit", "--", "true"], capture_output=True, text=True)
    assert bad.returncode == 2 and "give one rate or one per node" in bad.stderr


def test_everything_is_removed_when_interrupted():
    before, root_links = namespaces(), links()
    run = subprocess.Popen([*TOOL, "nodes=2", "--", "sleep", "60"], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 20
    while len(namespaces() - before) < 3 and time.time() < deadline:  # two nodes and the switch
        time.sleep(0.1)
    assert len(namespaces() - before) == 3
    run.send_signal(signal.SIGINT)
    assert run.wait(timeout=30) == 130
    assert namespaces() == before and links() == root_links


def test_two_emulated_nodes_reproduce_one_node(shards, tmp_path):
    common = ["trainer.max_steps=3", "trainer.precision=32", "trainer.checkpoint.every_n_steps=0"]
    one = run_train(cli_overrides(shards, tmp_path / "one") + common + ["trainer.devices=2"])
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [*TOOL, "nodes=2", "timeout=400", "--", sys.executable, str(REPO / "train.py")]
        + cli_overrides(shards, tmp_path / "two")
        + common
        + ["trainer.devices=1", "trainer.num_nodes=2"],
        capture_output=True,
        text=True,
        timeout=500,
        cwd=REPO,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    expected = [m["loss"] for m in read_metrics(tmp_path / "one")]
    assert [m["loss"] for m in read_metrics(tmp_path / "two")] == pytest.approx(expected, abs=1e-4)
