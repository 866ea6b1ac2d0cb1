"""A real SLURM of one node, or of several network namespaces, on this machine (Debian's slurm-wlm and munge),
for the tests and for trying the SLURM path without a cluster (docs/RECIPES.md "On a real SLURM here").

    python tools/local_slurm.py start dir=/tmp/slurm     # munged, slurmctld and slurmd; prints SLURM_CONF=...
    SLURM_CONF=/tmp/slurm/slurm.conf sbatch job.sbatch   # then sbatch, srun, squeue, scancel, scontrol as usual
    python tools/local_slurm.py stop dir=/tmp/slurm
    python tools/local_slurm.py start dir=/tmp/slurm nodes=2   # two nodes, each a network namespace (root, iproute2)

The daemons run as root (slurmd starts the jobs' processes), listen on 127.0.0.1 only
(``CommunicationParameters=NoCtldInAddrAny,NoInAddrAny``) on ports free at start, and authenticate every message
with a munge key made for this cluster alone. The node has this machine's CPUs and 80% of its memory, no GPUs, no
cgroups (``proctrack/linuxproc``, ``task/none``) and no accounting database (``sacct`` knows no job; ``squeue`` and
``scontrol`` do). ``JobRequeue=1`` and ``KillWait=30``, so a job can be requeued and its ranks get SIGTERM, then
30 s to stop, before SIGKILL. With ``nodes=N`` each node is a network namespace with its own slurmd, and the
daemons listen on the namespaces' private link instead (``_emulated_nodes``). Installing the packages: ``make
slurm`` (root, apt).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
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


def slurm_conf(
    root: Path, host: str, address: str, cpus: int, memory_mb: int, nodes: dict[str, str] | None = None
) -> str:
    """The controller runs on ``host`` at ``address``. ``nodes``: node name -> address, a slurmd each in its own
    network namespace (the controller in the first one's); None: one node, this machine, on 127.0.0.1."""
    ctld, slurmd = _free_ports(2)
    lines = {
        "ClusterName": "disttrain",
        "SlurmctldHost": f"{host}({address})",
        "SlurmctldPort": ctld,
        "SlurmdPort": slurmd,
        "CommunicationParameters": "NoCtldInAddrAny,NoInAddrAny",
        "SlurmUser": "root",
        "SlurmdUser": "root",
        "AuthType": "auth/munge",
        "AuthInfo": f"socket={root}/munge/munge.sock",
        "CredType": "cred/munge",
        "StateSaveLocation": root / "state",
        "SlurmdSpoolDir": root / "spool" / "%n",
        "SlurmctldPidFile": root / "slurmctld.pid",
        "SlurmdPidFile": root / "slurmd-%n.pid",
        "SlurmctldLogFile": root / "slurmctld.log",
        "SlurmdLogFile": root / "slurmd-%n.log",
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
    for name, node_address in (nodes or {host: "127.0.0.1"}).items():
        share = memory_mb // len(nodes or [host])
        text += f"NodeName={name} NodeAddr={node_address} CPUs={cpus} RealMemory={share} State=UNKNOWN\n"
    return text + "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"


def environment(root: Path) -> dict[str, str]:
    """The variables SLURM's commands need to reach this cluster."""
    return {**os.environ, "SLURM_CONF": str(Path(root) / "slurm.conf")}


def _run(args: list, **kwargs) -> None:
    subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True, timeout=60, **kwargs)


def _emulated_nodes(root: Path, count: int) -> dict[str, str]:
    """``count`` network namespaces joined by a bridge (tools/netem_cluster.py), and a link from this machine's
    namespace to that bridge for SLURM's commands (sbatch, squeue). Each namespace gets its own /etc/hosts
    (/etc/netns/<name>/hosts, as ``ip netns exec`` would mount it; ``_in_node``): the node names, and this machine's
    host name as the node's own address, which is what slurmctld, slurmd, srun and gloo bind to. Returns the nodes
    (name -> address); what was made is recorded in ``root``/nodes.json for ``stop``."""
    spec = importlib.util.spec_from_file_location("netem_cluster", Path(__file__).with_name("netem_cluster.py"))
    netem = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(netem)
    cluster = netem.Cluster(count, rate="10gbit", delay="0")
    nodes = {name: cluster.address(k) for k, name in enumerate(cluster.nodes)}
    link = f"{cluster.prefix}-c"
    (root / "nodes.json").write_text(json.dumps({"namespaces": [*cluster.nodes, cluster.switch], "link": link}))
    cluster.create()
    _run(["ip", "link", "add", link, "type", "veth", "peer", "name", "pc", "netns", cluster.switch])
    _run(["ip", "-n", cluster.switch, "link", "set", "pc", "master", "br0", "up"])
    _run(["ip", "addr", "add", f"{cluster.address(253)}/24", "dev", link])
    _run(["ip", "link", "set", link, "up"])
    machine = socket.gethostname()
    for name in nodes:
        table = ["127.0.0.1 localhost"] + [f"{a} {n}" + (f" {machine}" if n == name else "") for n, a in nodes.items()]
        (Path("/etc/netns") / name).mkdir(parents=True, exist_ok=True)
        (Path("/etc/netns") / name / "hosts").write_text("\n".join(table) + "\n")
    return nodes


def _in_node(name: str, command: list) -> list:
    """``command`` in node ``name``'s network namespace with its own /etc/hosts. Not ``ip netns exec``: that mounts
    a sysfs of the namespace's own, without /sys/fs/cgroup, and slurmd will not start without it."""
    hosts = Path("/etc/netns") / name / "hosts"
    inner = f"mount --bind {hosts} /etc/hosts && exec {shlex.join(str(c) for c in command)}"
    return ["nsenter", f"--net=/run/netns/{name}", "unshare", "--mount", "--", "sh", "-c", inner]


def start(root: Path, cpus: int | None = None, nodes: int = 1, timeout_s: float = 60.0) -> dict[str, str]:
    """Start munged, slurmctld and a slurmd per node with their state under ``root`` (emptied first); returns the
    environment for SLURM's commands once every node is idle. ``nodes`` > 1: each node is a network namespace of its
    own (``_emulated_nodes``)."""
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
    emulated = _emulated_nodes(root, nodes) if nodes > 1 else None
    # the controller runs in the first node; it checks that it is on SlurmctldHost by this machine's host name
    head, address = next(iter(emulated.items())) if emulated else (host, "127.0.0.1")
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, host, address, cpus or os.cpu_count() or 1, _memory_mb(), emulated))
    env = environment(root)
    _run(_in_node(head, ["slurmctld", "-f", conf]) if emulated else ["slurmctld", "-f", conf], env=env)
    if emulated is None:
        _run(["slurmd", "-f", conf], env=env)
    for name in emulated or {}:
        (root / "spool" / name).mkdir()
        _run(_in_node(name, ["slurmd", "-f", conf, "-N", name]), env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env, timeout=30)
        if state.stdout.split() == ["idle"]:
            return env
        time.sleep(0.5)
    log = (root / "slurmctld.log").read_text()[-2000:] if (root / "slurmctld.log").exists() else ""
    raise RuntimeError(f"the local SLURM's nodes did not become idle within {timeout_s:.0f} s: {log}")


def _pid_files(root: Path) -> list[Path]:
    return [*sorted(root.glob("slurmd*.pid")), root / "slurmctld.pid", root / "munge" / "munged.pid"]


def stop(root: Path) -> None:
    """Stop the daemons started under ``root`` (slurmd first) and remove its emulated nodes; nothing if none runs."""
    root = Path(root)
    for path in _pid_files(root):
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
    try:
        made = json.loads((root / "nodes.json").read_text())
    except (OSError, ValueError):
        return
    for name in made["namespaces"]:  # deleting the switch's namespace deletes the controller's link too
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
    (root / "nodes.json").unlink()


def main(argv: list[str]) -> int:
    verb = argv[0] if argv else ""
    options = dict(arg.split("=", 1) for arg in argv[1:] if "=" in arg)
    root = Path(options.get("dir", "/tmp/disttrain-slurm"))
    if verb == "start":
        try:
            start(root, int(options["cpus"]) if "cpus" in options else None, int(options.get("nodes", 1)))
        except RuntimeError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        print(f"export SLURM_CONF={root / 'slurm.conf'}")
        return 0
    if verb == "stop":
        stop(root)
        return 0
    usage = "usage: python tools/local_slurm.py start|stop [dir=/tmp/disttrain-slurm] [cpus=N] [nodes=N]"
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
