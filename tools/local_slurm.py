"""A real one-node SLURM on this machine (Debian's slurm-wlm and munge), for the tests and for trying the
SLURM path without a cluster (docs/RECIPES.md "On a real SLURM here").

    python tools/local_slurm.py start dir=/tmp/slurm     # munged, slurmctld and slurmd; prints SLURM_CONF=...
    SLURM_CONF=/tmp/slurm/slurm.conf sbatch job.sbatch   # then sbatch, srun, squeue, scancel, scontrol as usual
    python tools/local_slurm.py stop dir=/tmp/slurm

The daemons run as root (slurmd starts the jobs' processes), listen on 127.0.0.1 only
(``CommunicationParameters=NoCtldInAddrAny,NoInAddrAny``) on ports free at start, and authenticate every message
with a munge key made for this cluster alone. The node has this machine's CPUs and 80% of its memory, no GPUs, no
cgroups (``proctrack/linuxproc``, ``task/none``) and no accounting database (``sacct`` knows no job; ``squeue`` and
``scontrol`` do). ``JobRequeue=1`` and ``KillWait=30``, so a job can be requeued and its ranks get SIGTERM, then
30 s to stop, before SIGKILL. Installing the packages: ``make slurm`` (root, apt).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")


def missing() -> str | None:
    """Why no local SLURM can start here (None: it can)."""
    absent = [name for name in BINARIES if shutil.which(name) is None]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} not on PATH); make slurm installs it (root, apt)"
    if os.geteuid() != 0:
        return "a local SLURM runs its daemons as root; run as root, or point SLURM_CONF at a real cluster"
    return None


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _memory_mb() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * 0.8) >> 20


def slurm_conf(root: Path, host: str, cpus: int, memory_mb: int) -> str:
    ctld, slurmd = _free_ports(2)
    lines = {
        "ClusterName": "disttrain",
        "SlurmctldHost": f"{host}(127.0.0.1)",
        "SlurmctldPort": ctld,
        "SlurmdPort": slurmd,
        "CommunicationParameters": "NoCtldInAddrAny,NoInAddrAny",
        "SlurmUser": "root",
        "SlurmdUser": "root",
        "AuthType": "auth/munge",
        "AuthInfo": f"socket={root}/munge/munge.sock",
        "CredType": "cred/munge",
        "StateSaveLocation": root / "state",
        "SlurmdSpoolDir": root / "spool",
        "SlurmctldPidFile": root / "slurmctld.pid",
        "SlurmdPidFile": root / "slurmd.pid",
        "SlurmctldLogFile": root / "slurmctld.log",
        "SlurmdLogFile": root / "slurmd.log",
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_CPU",
        "MpiDefault": "none",
        "ReturnToService": 2,
        "JobRequeue": 1,
        "KillWait": 30,
        "MinJobAge": 600,  # finished jobs stay visible to scontrol for 10 minutes
    }
    text = "".join(f"{key}={value}\n" for key, value in lines.items())
    text += f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN\n"
    return text + "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"


def environment(root: Path) -> dict[str, str]:
    """The variables SLURM's commands need to reach this cluster."""
    return {**os.environ, "SLURM_CONF": str(Path(root) / "slurm.conf")}


def _run(args: list, **kwargs) -> None:
    subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True, timeout=60, **kwargs)


def start(root: Path, cpus: int | None = None, timeout_s: float = 60.0) -> dict[str, str]:
    """Start munged, slurmctld and slurmd with their state under ``root`` (emptied first); returns the environment
    for SLURM's commands once the node is idle."""
    reason = missing()
    if reason:
        raise RuntimeError(reason)
    root = Path(root)
    stop(root)
    shutil.rmtree(root, ignore_errors=True)
    for sub in ("munge", "state", "spool"):
        (root / sub).mkdir(parents=True)
    key = root / "munge" / "munge.key"
    _run(["mungekey", "--create", f"--keyfile={key}", "--force"])
    key.chmod(0o400)
    munge = root / "munge"
    _run(
        ["munged", f"--key-file={key}", f"--socket={munge}/munge.sock", f"--pid-file={munge}/munged.pid"]
        + [f"--log-file={munge}/munged.log", f"--seed-file={munge}/seed", "--force"]
    )
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, host, cpus or os.cpu_count() or 1, _memory_mb()))
    env = environment(root)
    _run(["slurmctld", "-f", conf], env=env)
    _run(["slurmd", "-f", conf], env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env, timeout=30)
        if state.stdout.strip() == "idle":
            return env
        time.sleep(0.5)
    log = (root / "slurmctld.log").read_text()[-2000:] if (root / "slurmctld.log").exists() else ""
    raise RuntimeError(f"the local SLURM node did not become idle within {timeout_s:.0f} s: {log}")


def _pid_files(root: Path) -> list[Path]:
    return [root / "slurmd.pid", root / "slurmctld.pid", root / "munge" / "munged.pid"]


def stop(root: Path) -> None:
    """Stop the daemons started under ``root`` (slurmd first); nothing if none runs."""
    for path in _pid_files(Path(root)):
        try:
            pid = int(path.read_text().split()[0])
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError, IndexError):
            continue
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except OSError:
                break
            time.sleep(0.1)


def main(argv: list[str]) -> int:
    verb = argv[0] if argv else ""
    options = dict(arg.split("=", 1) for arg in argv[1:] if "=" in arg)
    root = Path(options.get("dir", "/tmp/disttrain-slurm"))
    if verb == "start":
        try:
            start(root, int(options["cpus"]) if "cpus" in options else None)
        except RuntimeError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        print(f"export SLURM_CONF={root / 'slurm.conf'}")
        return 0
    if verb == "stop":
        stop(root)
        return 0
    print("usage: python tools/local_slurm.py start|stop [dir=/tmp/disttrain-slurm] [cpus=N]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
