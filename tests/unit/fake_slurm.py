"""A stand-in for SLURM's sbatch, srun and sacct on a machine without SLURM, for the launcher tests.

    python fake_slurm.py sbatch <script>     copies the script to $FAKE_SLURM_CAPTURE and prints "Submitted batch
                                             job <id>"; FAKE_SLURM_MODE=dump: no job runs, every task's result is
                                             written as a finished Hydra job; run: the script runs in the
                                             background as an allocation of its --nodes x --ntasks-per-node
    python fake_slurm.py srun [options] cmd  inside that allocation: one process per task with SLURM's per-task
                                             variables (rank, local rank, node), as srun starts them
    python fake_slurm.py sacct ...           knows no job (submitit then waits for the result files)
    python fake_slurm.py sbatch --test-only  accepts any script (a real SLURM checks it: tests/slurm/)

Only what submitit, Hydra's launcher and base/launch_env.py read is emulated: no resources, no signals.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

JOB_ID = os.environ.get("FAKE_SLURM_JOB_ID", "4242")


def sbatch_flags(text: str) -> dict[str, str]:
    flags = {}
    for match in re.finditer(r"^#SBATCH --([\w-]+)(?:=(.*))?$", text, re.MULTILINE):
        flags[match.group(1)] = match.group(2) if match.group(2) is not None else "true"
    return flags


def sbatch(script: str) -> int:
    text = Path(script).read_text()
    shutil.copyfile(script, os.environ["FAKE_SLURM_CAPTURE"])
    flags = sbatch_flags(text)
    nodes, per_node = int(flags.get("nodes", "1")), int(flags.get("ntasks-per-node", "1"))
    folder = Path(flags["output"].replace("%j", JOB_ID)).parent
    folder.mkdir(parents=True, exist_ok=True)
    if os.environ.get("FAKE_SLURM_MODE", "dump") == "dump":
        from hydra.core.utils import JobReturn, JobStatus

        done = JobReturn(status=JobStatus.COMPLETED, _return_value=None)
        for task in range(nodes * per_node):
            with open(folder / f"{JOB_ID}_{task}_result.pkl", "wb") as f:
                pickle.dump(("success", done), f)
    else:
        env = {
            **os.environ,
            "SLURM_JOB_ID": JOB_ID,
            "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_NNODES": str(nodes),
            "SLURM_NTASKS": str(nodes * per_node),
            "SLURM_NTASKS_PER_NODE": str(per_node),
            "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
            "SLURM_NODELIST": "127.0.0.1",
            "SLURM_JOB_NAME": flags.get("job-name", "job"),
        }
        log = open(folder / "fake_sbatch.log", "w")  # noqa: SIM115  the background job owns it
        job = subprocess.Popen(["bash", script], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        (folder / "fake_sbatch.pid").write_text(str(job.pid))  # its process group, for the test to end
    print(f"Submitted batch job {JOB_ID}")
    return 0


def srun(args: list[str]) -> int:
    out = err = None
    while args and args[0].startswith("--"):
        option = args.pop(0)
        if option in ("--output", "--error"):
            value = args.pop(0)
            out, err = (value, err) if option == "--output" else (out, value)
    nodes, per_node = int(os.environ["SLURM_NNODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
    with socket.socket() as probe:  # a free port for the job's rendezvous (SLURM derives one from the job id)
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    tasks = []
    for task in range(nodes * per_node):
        env = {
            **os.environ,
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(task),
            "SLURM_LOCALID": str(task % per_node),
            "SLURM_NODEID": str(task // per_node),
            "MASTER_PORT": port,
        }
        stdout = open(out.replace("%j", env["SLURM_JOB_ID"]).replace("%t", str(task)), "a")  # noqa: SIM115
        stderr = open(err.replace("%j", env["SLURM_JOB_ID"]).replace("%t", str(task)), "a") if err else stdout  # noqa: SIM115
        tasks.append(subprocess.Popen(args, env=env, stdout=stdout, stderr=stderr))
    return max(task.wait() for task in tasks)


def main(argv: list[str]) -> int:
    command, rest = argv[0], argv[1:]
    if command == "sbatch" and "--test-only" in rest:  # train.py's preflight: the fake accepts every job
        print(f"sbatch: Job {JOB_ID} to start at now", file=sys.stderr)
        return 0
    if command == "sbatch":
        return sbatch(rest[-1])
    if command == "srun":
        return srun(rest)
    if command == "sacct":
        print("JobID|State|NodeList")
        return 0
    raise SystemExit(f"fake_slurm: unknown command {command}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
