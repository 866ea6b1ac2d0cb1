"""An emulated multi-node cluster on one machine: network namespaces, veth links, tc netem.

    sudo python tools/netem_cluster.py nodes=2 rate=1gbit delay=0.1ms -- \\
        python train.py trainer.num_nodes=2 trainer.devices=1 hydra.run.dir=outputs/netem

Each "node" is a network namespace with one interface (``eth0``, 10.77.<net>.<k+1>/24) whose
veth peer sits on a bridge inside a private "switch" namespace; the node's egress is shaped
with a ``tbf`` qdisc at ``rate`` and, when the kernel has ``sch_netem``, a ``netem delay``
child (this machine's kernel has no netem: links are rate-limited only, and the tool says so).
The command runs once per node inside its namespace with ``NODE_RANK``, ``MASTER_ADDR`` (node
0's address), ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME=eth0`` set, so ``train.py``'s launcher
forms one job across the nodes. The namespaces have no route anywhere else: traffic stays
between them. Everything is removed afterwards -- on success, on failure, and on Ctrl-C or
SIGTERM (deleting a namespace deletes its interfaces, their veth peers and their qdiscs).

Needs root and iproute2 (``ip``, ``tc``). Options: ``nodes`` (2), ``rate`` (1gbit; a comma-separated
list gives each node its own egress rate, e.g. ``rate=1gbit,100mbit``), ``delay`` (0.1ms), ``port``
(29500), ``timeout`` seconds for the command (0: none), ``pin`` (false; true: node k's processes run on
core k only -- the affinity ``taskset -c k`` would set -- so one node cannot borrow another's core).
Exit status: the first non-zero status of the node commands, else 0.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

OPTIONS = {"nodes": "2", "rate": "1gbit", "delay": "0.1ms", "port": "29500", "timeout": "0", "pin": "false"}


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


class Cluster:
    def __init__(self, nodes: int, rate: str, delay: str):
        rates = rate.split(",")
        if len(rates) not in (1, nodes):
            raise ValueError(f"rate={rate}: give one rate or one per node ({nodes})")
        tag = f"{os.getpid() % 100000}"
        self.prefix = f"dtn{tag}"
        self.switch = f"{self.prefix}-sw"
        self.nodes = [f"{self.prefix}-n{k}" for k in range(nodes)]
        self.subnet = 10 + os.getpid() % 200  # 10.77.<subnet>.0/24, private to these namespaces
        self.rates = rates * nodes if len(rates) == 1 else rates
        self.delay = delay
        self.warned = False

    def address(self, k: int) -> str:
        return f"10.77.{self.subnet}.{k + 1}"

    def create(self) -> None:
        run("ip", "netns", "add", self.switch)
        run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for k, ns in enumerate(self.nodes):
            run("ip", "netns", "add", ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
            # create the pair inside the switch namespace, then move one end into the node
            run("ip", "-n", self.switch, "link", "add", f"p{k}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            run("ip", "-n", self.switch, "link", "set", f"p{k}", "master", "br0")
            run("ip", "-n", self.switch, "link", "set", f"p{k}", "up")
            run("ip", "-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            self._shape(ns, self.rates[k])

    def _shape(self, ns: str, rate: str) -> None:
        """Rate with tbf; delay with a netem child when the kernel has sch_netem."""
        tc = ("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0")
        run(*tc, "root", "handle", "1:", "tbf", "rate", rate, "burst", "512kb", "latency", "100ms")
        if self.delay not in ("0", "0ms", ""):
            delayed = run(*tc, "parent", "1:1", "handle", "10:", "netem", "delay", self.delay, check=False)
            if delayed.returncode and not self.warned:
                print(
                    f"netem_cluster: this kernel has no netem qdisc ({delayed.stderr.strip()}): "
                    f"links are rate-limited to {','.join(self.rates)} but not delayed",
                    file=sys.stderr,
                )
                self.warned = True

    def destroy(self) -> None:
        for ns in [*self.nodes, self.switch]:
            run("ip", "netns", "delete", ns, check=False)

    def leftovers(self) -> list[str]:
        listed = run("ip", "netns", "list", check=False).stdout
        return [line.split()[0] for line in listed.splitlines() if line.startswith(self.prefix)]


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print(__doc__)
        return 2
    split = argv.index("--")
    options = dict(OPTIONS)
    for arg in argv[:split]:
        name, _, value = arg.partition("=")
        if name not in options:
            print(f"error: unknown option {name!r}; options: {', '.join(OPTIONS)}", file=sys.stderr)
            return 2
        options[name] = value
    command = argv[split + 1 :]
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print("error: the emulated cluster needs root and iproute2 (ip, tc)", file=sys.stderr)
        return 2
    pin = options["pin"].lower() in ("1", "true", "yes")
    cores = sorted(os.sched_getaffinity(0))
    try:
        cluster = Cluster(int(options["nodes"]), options["rate"], options["delay"])
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    processes: list[subprocess.Popen] = []

    def stop(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        cluster.create()
        for k, ns in enumerate(cluster.nodes):
            env = {
                **os.environ,
                "NODE_RANK": str(k),
                "MASTER_ADDR": cluster.address(0),
                "MASTER_PORT": options["port"],
                "GLOO_SOCKET_IFNAME": "eth0",
                "NCCL_SOCKET_IFNAME": "eth0",
            }
            pinned = (lambda core=cores[k % len(cores)]: os.sched_setaffinity(0, {core})) if pin else None
            processes.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, *command], env=env, start_new_session=True, preexec_fn=pinned
                )
            )
        deadline = time.time() + float(options["timeout"]) if float(options["timeout"]) > 0 else None
        while any(p.poll() is None for p in processes):
            if deadline and time.time() > deadline:
                raise TimeoutError(f"the command ran longer than {options['timeout']} s")
            if any(p.returncode not in (None, 0) for p in processes):
                break  # one node failed: the others would wait for it forever
            time.sleep(0.2)
        status = next((p.returncode for p in processes if p.returncode), 0)
    except (KeyboardInterrupt, TimeoutError) as error:
        print(f"netem_cluster: stopping ({error})", file=sys.stderr)
        status = 130
    finally:
        for p in processes:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(timeout=10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(p.pid, signal.SIGKILL)
        cluster.destroy()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        left = cluster.leftovers()
        if left:
            print(f"netem_cluster: could not remove {left}", file=sys.stderr)
            status = status or 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
