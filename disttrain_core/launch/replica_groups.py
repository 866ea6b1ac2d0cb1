"""Starting a fault-tolerant job (``trainer.fault_tolerance``): a Lighthouse, then replica groups, each replaced alone.

train.py starts torchft's Lighthouse on ``bind`` (or checks the one ``lighthouse=HOST:PORT`` names answers within
2 s), then ``replicas`` groups of ``trainer.devices / replicas`` processes. Each group is an ordinary run of
its own (its own process group, DDP inside it) that meets the others through the Lighthouse every step
(train/fault_tolerance/replica.py). When a process dies its group's other processes are stopped, and with
``replace=true`` the group is started again after ``replace_delay_s``: it joins a later quorum and receives the
state from a healthy group. The other groups' processes are never touched. When every group has finished, the
failures, replacements and each group's last state are written to ``fault_tolerance.json`` in the run directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed import TCPStore

from ..base.launch_env import MARK, LaunchError
from ..base.net import split_address
from ..config import typed_config
from ..config.fault_tolerance import quorum_minimum
from ..train.fault_tolerance.replica import KEY_ENV, LIGHTHOUSE_ENV, REPLICA_ENV, START_ENV, STORE_ENV
from ..train.fault_tolerance.workers import JOB_STORE_ENV, at_key, given_up_key

log = logging.getLogger("disttrain")
POLL_S = 0.1
CAUSE_WAIT_S = 1.0  # how long a process that raised waits to be explained by its group's peer killed by a signal


def lighthouse_reachable(address: str, timeout: float = 2.0) -> None:
    """A Lighthouse answers at ``address`` (host:port) within ``timeout`` seconds, or one line says it does not."""
    host, port = split_address(address)
    url = f"http://{host}:{port}/"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:  # its dashboard page
            page = reply.read(4096)
    except (OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise LaunchError(
            f"trainer.fault_tolerance.lighthouse={address}: no Lighthouse answers there within {timeout:g} s "
            f"({reason}); start one (torchft_lighthouse --bind {host}:{port} --min_replicas N) or leave it unset "
            "so train.py starts one"
        ) from None
    if b"torchft" not in page:
        raise LaunchError(
            f"trainer.fault_tolerance.lighthouse={address}: something answers there, but not a torchft Lighthouse"
        )


def start_lighthouse(ft, min_replicas: int):
    """torchft's Lighthouse on ``ft.bind`` (a free port); returns (server, its address as host:port)."""
    os.environ.setdefault("RUST_LOG", "warn")  # read once, when torchft's Rust side starts: not every quorum
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind=f"{ft.bind}:0",
        min_replicas=min_replicas,
        join_timeout_ms=ft.join_timeout_ms,
        heartbeat_timeout_ms=ft.heartbeat_timeout_ms,
    )
    port = int(server.address().rsplit(":", 1)[1])  # it advertises the machine's hostname; peers use bind
    return server, f"{ft.bind}:{port}"


def group_run(run, group_size: int):
    """The run one replica group executes: the job's config (validated whole) on ``group_size`` processes,
    resolved again."""
    from ..parallel.resolved import resolve_run

    container = {**run.container, "trainer": {**run.container["trainer"], "devices": group_size}}
    dp = container["parallel"].get("dp", -1)
    if dp > 0:  # the job's data-parallel copies, split among its groups (validation/fault_tolerance.py)
        replicas = run.cfg.trainer.fault_tolerance.replicas
        container["parallel"] = {**container["parallel"], "dp": dp // replicas}
    return resolve_run(typed_config(container), container)


def _rank_main(run, run_dir: str, environ: dict[str, str]) -> None:
    os.environ.update(environ)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a fork server ignores it (launch/rank_preload.py)
    import traceback

    from ..base.processes import end_helpers
    from .worker import run_worker

    code = 0
    try:
        run_worker(run, run_dir)
    except BaseException as error:  # the launcher stops and replaces the group: one line, the traceback on disk
        code = 1
        _report_failure(error, traceback.format_exc(), run_dir, environ)
    # Leave without multiprocessing's exit handlers: they would wait for the decode workers, which ignore the
    # SIGTERM it ends them with (base/processes.py); the run's files are closed by now.
    end_helpers()
    from multiprocessing import util

    util._run_finalizers(0)  # what the exit handlers would run first: named semaphores unlinked (tqdm's lock)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report_failure(error: BaseException, trace: str, run_dir: str, environ: dict[str, str]) -> None:
    """A group's rank that raised (often a collateral of its peer's death: a collective reset): one line on the
    console, the whole traceback in its group's directory."""
    group, rank, start = environ[REPLICA_ENV], environ["RANK"], environ[START_ENV]
    path = Path(run_dir) / "replicas" / f"r{group}" / f"error_rank{rank}_start{start}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(trace)
        where = f"traceback in {path}"
    except OSError:
        print(trace, file=sys.stderr)
        where = "traceback above"
    first = (str(error).strip().splitlines() or [""])[0][:300]
    print(f"replica group {group} rank {rank} failed: {type(error).__name__}: {first} ({where})", file=sys.stderr)


def _failed(group) -> list[tuple[int, int]]:
    """(rank, exit code) of the group's processes that ended in failure (a signal: a negative code)."""
    return [(rank, p.exitcode) for rank, p in enumerate(group.processes) if p.exitcode not in (None, 0)]


@dataclass
class Group:
    index: int
    processes: list = field(default_factory=list)
    starts: int = 0
    pids: list = field(default_factory=list)  # of every start: [[rank 0's pid, ...], ...]
    died_at: float | None = None  # when its last failure was seen (None: running or finished)
    finished: bool = False
    given_up: bool = False
    stores: list = field(default_factory=list)  # its start's stores, served by the launcher


class ReplicaGroups:
    """The supervisor of a fault-tolerant job's groups (module docstring)."""

    def __init__(self, run, run_dir: str, job_id: str):
        from ..data.transport import new_key

        self.run, self.run_dir, self.job_id = run, run_dir, job_id
        cfg = run.cfg
        self.ft = cfg.trainer.fault_tolerance
        self.size = cfg.trainer.devices // self.ft.replicas
        self.group_run = group_run(run, self.size)
        self.key = self.ft.key or new_key()
        self.context = multiprocessing.get_context(cfg.trainer.start_method)
        if cfg.trainer.start_method == "forkserver":
            from .fabric import PRELOAD

            multiprocessing.set_forkserver_preload([PRELOAD])
        self.groups = [Group(g) for g in range(self.ft.replicas)]
        # the job's store: which groups died or were given up on, for local SGD's syncs (train/fault_tolerance/
        # workers.py); small text values only
        self.store = TCPStore(self.ft.bind, 0, is_master=True, wait_for_workers=False)
        self.failures: list[dict] = []
        self.lighthouse = None
        self.stopping = False  # a signal asked every group to stop: none is replaced
        # a replacement resumes from the job's newest checkpoint, then heals from a healthy group if one is ahead
        container = self.group_run.container
        self.replacement_run = self.group_run.with_container(
            {**container, "trainer": {**container["trainer"], "resume": "auto"}}
        )

    def _environment(self, group: Group) -> dict[str, str]:
        # This start's two stores, served here (fresh, port 0: no port picked now and bound later by a rank, which
        # another socket may take meanwhile): torchft's for the group, and the rendezvous of its process group
        # (torch's agent-store protocol: every rank a client).
        group.stores = [TCPStore(self.ft.bind, 0, is_master=True, wait_for_workers=False) for _ in range(2)]
        torchft_store, rendezvous = group.stores
        return {
            MARK: "spawn",
            "DISTTRAIN_JOB_ID": self.job_id,
            REPLICA_ENV: str(group.index),
            START_ENV: str(group.starts),
            STORE_ENV: f"{self.ft.bind}:{torchft_store.port}",
            LIGHTHOUSE_ENV: f"http://{self.address}",
            JOB_STORE_ENV: f"{self.ft.bind}:{self.store.port}",
            KEY_ENV: self.key,
            "RUST_LOG": os.environ.get("RUST_LOG", "warn"),  # torchft's Rust side logs every quorum at info
            "MASTER_ADDR": self.ft.bind,
            "MASTER_PORT": str(rendezvous.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "WORLD_SIZE": str(self.size),
            "NODE_RANK": "0",
        }

    def _record(self, group: Group) -> Path:
        return Path(self.run_dir) / "replicas" / f"r{group.index}" / "fault_tolerance.json"

    def _start(self, group: Group) -> None:
        self._record(group).unlink(missing_ok=True)  # written when this start of the group finishes training
        environ = self._environment(group)
        group.processes = []
        for rank in range(self.size):
            env = {**environ, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            run = self.group_run if group.starts == 0 else self.replacement_run
            process = self.context.Process(target=_rank_main, args=(run, self.run_dir, env), daemon=False)
            process.start()
            group.processes.append(process)
        group.starts += 1
        group.pids.append([p.pid for p in group.processes])
        group.died_at = None
        what = "started" if group.starts == 1 else f"replaced (start {group.starts})"
        log.info("replica group %d %s: pid(s) %s", group.index, what, ",".join(str(p.pid) for p in group.processes))

    def _first_cause(self, group: Group, failed: list[tuple[int, int]]) -> tuple[int, int]:
        """The failure to record: a process that raised is often the collateral of a peer killed a moment before
        (its collective was reset), whose death the fork server may report a little later: wait up to
        ``CAUSE_WAIT_S`` for a death by signal in the group, and prefer it."""
        deadline = time.monotonic() + CAUSE_WAIT_S
        while not any(code < 0 for _, code in failed) and time.monotonic() < deadline:
            time.sleep(POLL_S)
            failed = _failed(group)
        return min(failed, key=lambda item: (item[1] > 0, item[0]))

    def run_all(self) -> dict:
        ft = self.ft
        minimum = quorum_minimum(ft)
        if ft.lighthouse:  # checked before launch (launch/entry.py)
            self.address = ft.lighthouse
        else:
            self.lighthouse, self.address = start_lighthouse(ft, minimum)
            log.info("torchft Lighthouse on %s (min_replicas=%d)", self.address, minimum)
        log.info("%d replica groups of %d process(es)", ft.replicas, self.size)
        previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for group in self.groups:
                self._start(group)
            ended_at = None  # when the first group finished training: the job's end
            while not all(g.finished or g.given_up for g in self.groups):
                time.sleep(POLL_S)
                for group in self.groups:
                    self._watch(group, replace=ended_at is None)
                if ended_at is None and any(g.finished for g in self.groups):
                    ended_at = time.monotonic()
                if ended_at is not None and time.monotonic() - ended_at > self.ft.timeout_s + 30:
                    for group in self.groups:  # a replacement still waiting for a quorum that will not come
                        if not (group.finished or group.given_up):
                            log.warning("replica group %d did not finish with the others; stopped", group.index)
                            self._stop(group)
                            self._give_up(group)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for group in self.groups:
                self._stop(group)
            if self.lighthouse is not None:
                self.lighthouse.shutdown()
        return self._report()

    def _watch(self, group: Group, replace: bool) -> None:
        """``replace``: whether a dead group may be started again (not once the job's end was reached)."""
        if group.finished or group.given_up:
            return
        if group.died_at is not None:  # waiting to replace it
            waited = time.monotonic() - group.died_at
            spent = group.starts > self.ft.max_replacements
            if waited >= self.ft.replace_timeout_s or not replace or spent or self.stopping:
                self._give_up(group)
                log.warning("replica group %d: not replaced (%.0f s); the job goes on without it", group.index, waited)
            elif self.ft.replace and waited >= self.ft.replace_delay_s:
                self._start(group)
            return
        codes = [p.exitcode for p in group.processes]
        if all(code == 0 for code in codes) or (all(c is not None for c in codes) and self._record(group).is_file()):
            group.finished = True  # (a process that failed after its group wrote its record still trained)
            return
        failed = _failed(group)
        if not failed:
            return
        if self.stopping:  # stopped at an agreed step after a signal, not failed
            self._stop(group)
            self._give_up(group)
            return
        rank, code = self._first_cause(group, failed)
        cause = signal.Signals(-code).name if code < 0 else f"exit status {code}"
        failure = {"group": group.index, "rank": rank, "cause": cause, "start": group.starts - 1, "time": time.time()}
        self.failures.append(failure)
        log.warning(
            "replica group %d: rank %d died (%s); its group is stopped%s, the others go on",
            group.index,
            rank,
            cause,
            " and will be replaced" if self.ft.replace else "",
        )
        self._stop(group)
        self.store.delete_key(at_key(group.index))  # a local-SGD sync waits for its replacement
        group.died_at = time.monotonic()
        if not self.ft.replace:
            self._give_up(group)

    def _give_up(self, group: Group) -> None:
        group.given_up = True
        self.store.set(given_up_key(group.index), "1")  # local SGD's syncs go on without it

    def _stop(self, group: Group) -> None:
        for process in group.processes:
            if process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
            process.join(timeout=10)

    def _forward(self, signum: int, frame) -> None:
        log.warning("%s: asking every replica group to stop", signal.Signals(signum).name)
        self.stopping = True
        for group in self.groups:
            for process in group.processes:
                if process.exitcode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process.pid, signal.SIGTERM)

    def _report(self) -> dict:
        groups = {}
        for group in self.groups:
            path = self._record(group)
            groups[str(group.index)] = json.loads(path.read_text()) if path.is_file() else None
        report = {
            "replicas": self.ft.replicas,
            "group_size": self.size,
            "failures": self.failures,
            "starts": {str(g.index): g.starts for g in self.groups},
            "pids": {str(g.index): g.pids for g in self.groups},
            "given_up": [g.index for g in self.groups if g.given_up],
            "groups": groups,
        }
        (Path(self.run_dir) / "fault_tolerance.json").write_text(json.dumps(report, indent=1))
        return report


def run_replica_groups(run, run_dir: str, job_id: str) -> None:
    from .launchers import RankFailed

    report = ReplicaGroups(run, run_dir, job_id).run_all()
    if not any(group for group in report["groups"].values()):
        counts = Counter(f"group {f['group']} rank {f['rank']} ({f['cause']})" for f in report["failures"])
        failures = "; ".join(what + (f" x{n}" if n > 1 else "") for what, n in counts.items())
        raise RankFailed(f"no replica group finished training ({failures or 'no failure recorded'})")
