"""Two hosts under a real SLURM (issue 65): two slurmd, each in a network namespace of its own
(tools/local_slurm.py ``nodes=2``), the controller in the first. The recipe's sbatch script asks for 2 nodes x 2
tasks; srun starts two ranks in each namespace, and they meet over the namespaces' link (gloo), not over loopback.
Its losses equal one process's with the same global batch."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import REPO, cli_overrides, read_metrics, run_train
from .conftest import job_logs, job_state, local_slurm, submit, wait_for

pytestmark = pytest.mark.skipif(
    not shutil.which("ip") or not shutil.which("nsenter"), reason="two SLURM nodes need iproute2 and nsenter"
)
STEPS = 4
RECIPE = "recipe=mllm_tiny_ddp2"
SAME = ["trainer.precision=32", f"trainer.max_steps={STEPS}"]
LAYOUTS = {  # the one process's overrides, the job's, and its tasks per node
    # dp 4 (2 nodes x 2 tasks) x micro-batch 4 = the recipe's global batch of 16; one process accumulates 4
    "dp4": (["optim.micro_batch_size=4"], ["optim.micro_batch_size=4"], "2"),
    # the encoder unit on one node, the LLM unit on the other: the broker's sends cross the link. One task per
    # node (srun), which starts that node's rank itself
    "disagg2": ([], ["parallel=disagg2", "trainer.devices=1"], "1"),
}


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    reason = local_slurm.missing()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm2")
    env = local_slurm.start(root, nodes=2)
    yield env
    local_slurm.stop(root)
    assert not (root / "nodes.json").exists()


def _losses(run_dir: Path) -> dict[int, float]:
    return {int(m["step"]): m["loss"] for m in read_metrics(run_dir) if "loss" in m}


@pytest.mark.parametrize("layout", ["dp4", pytest.param("disagg2", marks=pytest.mark.slow)])
def test_two_nodes_train_like_one_process(two_nodes, shards, tmp_path, layout):
    alone, chosen, tasks_per_node = LAYOUTS[layout]
    one = tmp_path / "one"
    result = run_train([RECIPE, *cli_overrides(shards, one), *SAME, *alone, "trainer.devices=1"])
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    args = [RECIPE, "format=sbatch", "hydra.launcher.cpus_per_task=1", "trainer.num_nodes=2", *SAME, *chosen]
    made = subprocess.run(
        [sys.executable, str(REPO / "tools" / "launch_script.py"), *args, *cli_overrides(shards, run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert made.returncode == 0, made.stderr
    assert "#SBATCH --nodes=2" in made.stdout and f"#SBATCH --ntasks-per-node={tasks_per_node}" in made.stdout
    (tmp_path / "logs").mkdir()
    script = tmp_path / "job.sbatch"
    script.write_text(made.stdout.replace(str(REPO / "outputs" / "slurm"), str(tmp_path / "logs")))
    job = submit(two_nodes, script)
    done = wait_for(two_nodes, job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    assert done["JobState"] == "COMPLETED", job_logs(tmp_path / "logs")
    assert done["NumNodes"] == "2" and done["NumTasks"] == str(2 * int(tasks_per_node)), done
    assert job_state(two_nodes, job)["NodeList"].endswith("-n[0-1]")
    expected, losses = _losses(one), _losses(run_dir)
    assert sorted(losses) == sorted(expected) == list(range(1, STEPS + 1))
    for step, loss in expected.items():
        assert losses[step] == pytest.approx(loss, abs=1e-4), step
