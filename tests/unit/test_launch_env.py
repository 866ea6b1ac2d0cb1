"""How a job was started, read from the environment, and the one-line refusals before anything starts
(base/launch_env.py); helper processes that die with their parent (base/processes.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from disttrain_core.base.launch_env import LaunchError, check, detect, elastic_nodes, tasks_per_node
from disttrain_core.config import run_stamp

SRUN = {
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_ID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
}


def test_srun_one_task_per_rank():
    env = detect(SRUN)
    assert (env.kind, env.world_size, env.rank, env.local_rank, env.node_rank) == ("slurm", 4, 3, 1, 1)
    assert env.external and env.job_id == "77.3"
    check(env, devices=2, num_nodes=2, environ=SRUN)
    with pytest.raises(LaunchError, match=r"SLURM_NTASKS \(srun\)=4 processes, but trainer.devices=4"):
        check(env, devices=4, num_nodes=2, environ=SRUN)
    uneven = {**SRUN, "SLURM_TASKS_PER_NODE": "3,1"}
    with pytest.raises(LaunchError, match="srun --ntasks-per-node=2"):
        check(detect(uneven), devices=2, num_nodes=2, environ=uneven)
    with pytest.raises(LaunchError, match="trainer.max_restarts=1 .* set trainer.max_restarts=0"):
        check(env, devices=2, num_nodes=2, max_restarts=1, environ=SRUN)


def test_srun_one_task_per_node_spawns_that_nodes_ranks():
    env_vars = {**SRUN, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1(x2)"}
    env = detect(env_vars)
    assert (env.kind, env.node_rank, env.external, env.job_scoped) == ("node", 1, False, True)
    check(env, devices=8, num_nodes=2, environ=env_vars)
    with pytest.raises(LaunchError, match="SLURM_NNODES=2 nodes but trainer.num_nodes=4"):
        check(env, devices=8, num_nodes=4, environ=env_vars)


def test_batch_step_without_srun_is_refused():
    batch = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}
    with pytest.raises(LaunchError, match="no srun: .*srun python train.py"):
        check(detect(batch), devices=2, num_nodes=2, environ=batch)


def test_an_allocation_of_one_task_is_a_local_launch():
    local = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}
    env = detect(local)
    assert env.kind == "local" and not env.job_scoped
    check(env, devices=2, num_nodes=1, environ=local)


def test_torchrun():
    env_vars = {
        "TORCHELASTIC_RUN_ID": "abc",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
    }
    env = detect(env_vars)
    assert (env.kind, env.rank, env.job_id) == ("torchrun", 1, "abc")
    check(env, devices=2, num_nodes=1, environ=env_vars)
    with pytest.raises(LaunchError, match="WORLD_SIZE \\(torchrun\\)=2 processes"):
        check(env, devices=4, num_nodes=1, environ=env_vars)
    unnamed = {**env_vars, "TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "4"}
    with pytest.raises(LaunchError, match="--rdzv-id"):
        check(detect(unnamed), devices=2, num_nodes=2, environ=unnamed)


def test_an_elastic_round_trains_on_the_nodes_it_has_and_only_under_torchrun():
    """trainer.min_nodes (torchrun --nnodes=MIN:MAX): the round's node count is WORLD_SIZE / LOCAL_WORLD_SIZE."""
    round_of = {"TORCHELASTIC_RUN_ID": "j", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    for world, nodes in (("2", 1), ("4", 2)):
        env_vars = {**round_of, "WORLD_SIZE": world}
        assert elastic_nodes(detect(env_vars), num_nodes=2, min_nodes=1, environ=env_vars) == nodes
    assert elastic_nodes(detect({}), num_nodes=2, min_nodes=None) == 2  # not elastic: trainer.num_nodes
    too_few = {**round_of, "WORLD_SIZE": "2"}
    with pytest.raises(LaunchError, match="WORLD_SIZE=2 processes, 2 per node, but an elastic job takes 2 to 3 nodes"):
        elastic_nodes(detect(too_few), num_nodes=3, min_nodes=2, environ=too_few)
    with pytest.raises(LaunchError, match="only torchrun --nnodes=1:2 does .*started by local"):
        elastic_nodes(detect({}), num_nodes=2, min_nodes=1, environ={})
    with pytest.raises(LaunchError, match=r"trainer.min_nodes=3: use null \(not elastic\) or 1 to trainer.num_nodes=2"):
        elastic_nodes(detect(too_few), num_nodes=2, min_nodes=3, environ=too_few)


def test_spawned_children_ignore_an_inherited_slurm_environment():
    env = detect({**SRUN, "DISTTRAIN_LAUNCHER": "spawn", "LOCAL_RANK": "1"})
    assert env.kind == "spawned" and not env.external


def test_tasks_per_node_format():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(LaunchError, match="SLURM's format"):
        tasks_per_node("two")


def test_run_directory_is_named_by_the_job(monkeypatch):
    for name, value in SRUN.items():
        monkeypatch.setenv(name, value)
    assert run_stamp("2026-01-01_00-00-00") == "job-77.3"
    for name in SRUN:
        monkeypatch.delenv(name)
    assert run_stamp("2026-01-01_00-00-00") == "2026-01-01_00-00-00"


CHILD = """
import os, signal, subprocess, sys, time
sys.path.insert(0, {repo!r})
grandchild = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time
sys.path.insert(0, {repo!r})
from disttrain_core.base.processes import helper_process_init
helper_process_init(int(sys.argv[1]))
print(os.getpid(), flush=True)
time.sleep(60)
''', str(os.getpid())], stdout=subprocess.PIPE, text=True)
print(grandchild.stdout.readline().strip(), flush=True)
time.sleep(60)
"""


def test_a_helper_dies_with_its_parent_however_it_dies():
    repo = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    parent = subprocess.Popen([sys.executable, "-c", CHILD.format(repo=repo)], stdout=subprocess.PIPE, text=True)
    try:
        helper = int(parent.stdout.readline())
        os.kill(helper, 0)  # alive
        parent.kill()  # SIGKILL: no handler, no cleanup
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(helper, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        pytest.fail("the helper outlived its parent")
    finally:
        parent.kill()
