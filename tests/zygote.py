"""A warm interpreter for the suite's ``python train.py`` runs (``conftest.run_train``).

A cold ``python train.py`` spends about 3.5 s of a core importing torch, Lightning, Hydra and this
package before it reads its arguments, and its fork server (trainer.start_method=forkserver, the
default) spends as much again importing the same modules for the ranks. The suite starts a few hundred
such runs. Here one server process per test session imports all of that once; each run is a fork of it
that executes train.py as ``__main__`` with the run's arguments, working directory, environment and
output files, exactly as ``python train.py`` would from that point on. Its fork server is a fork too
(started by train.py's own ``warm_up`` before any kernel has run, so forking stays safe: the ranks are
forks of a process that never ran an OpenMP region; a process that has run one cannot fork a child that
runs another -- GNU OpenMP hangs). Everything after the imports is the real code path: argument checks,
Hydra, validation, the launcher, Fabric's forkserver launcher, the ranks. Other scripts (the tools) run
the same way, with fresh fork servers: they may run kernels before they start one.

The fault suite's jobs (tests/faults/conftest.py: ``Job``) run here too, through ``start``: a
``WarmProcess`` they signal and wait for like a ``Popen``, in its own session as before. What a fork cannot
show, a cold run still does: tests that time train.py's start-up or start it under torchrun or srun use
``subprocess`` themselves, and ``DISTTRAIN_TEST_COLD=1`` makes ``run_script``, ``run_train`` and ``Job`` start a
fresh interpreter for every run instead.

Protocol: one JSON request per line on the server's stdin (script, argv, cwd, env, output paths); the
server answers ``{"pid": ...}`` when the run starts and ``{"status": ...}`` (an exit code, negative for a
signal) when it ends. The server runs one request at a time and serves only the test session that
started it (pipes, never a socket).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FORKSERVER_MAIN = "from multiprocessing.forkserver import main"


def _warm_imports() -> None:
    """What train.py, its launcher and a rank import, and one Hydra composition (plugin discovery)."""
    import hydra
    import lightning_fabric  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401  the default tracker's writer

    from disttrain_core.config import register_configs
    from disttrain_core.launch import cli, entry, fabric, worker  # noqa: F401
    from disttrain_core.train import loop  # noqa: F401

    register_configs()
    with hydra.initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        hydra.compose("config")


def _forking_spawnv(real):
    """``multiprocessing.util.spawnv_passfds`` that forks the fork server instead of starting a fresh
    interpreter for it: the child keeps only the descriptors a fresh one would get and runs the same
    ``-c`` program. Every other program (spawned ranks, the resource tracker) starts as before."""

    def spawnv_passfds(path, args, passfds):
        program = args[-1]
        if not program.startswith(FORKSERVER_MAIN):
            return real(path, args, passfds)
        pid = os.fork()
        if pid:
            return pid
        try:
            import logging
            import signal

            logging.getLogger().handlers.clear()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            keep = {0, 1, 2, *passfds}
            for fd in (int(name) for name in os.listdir("/proc/self/fd")):
                if fd not in keep:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            exec(program, {"__name__": "__forkserver__"})
        except SystemExit:  # the server's way out once its launcher has gone
            pass
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(1)
        os._exit(0)

    return spawnv_passfds


def _run(request: dict, protocol: set[int]) -> None:
    """In the forked child: become ``python train.py argv...`` and exit with its status."""
    import runpy
    from multiprocessing import util

    code = 1
    try:
        os.setsid()  # its own process group: a timeout kills the run with its server and ranks
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            if path is None:  # stderr into stdout (``stderr=subprocess.STDOUT``)
                os.dup2(1, fd)
                continue
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        for fd in protocol | {null}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if request["fork_server"]:
            util.spawnv_passfds = _forking_spawnv(util.spawnv_passfds)
        sys.argv = [request["script"], *request["argv"]]
        runpy.run_path(request["script"], run_name="__main__")
        code = 0
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """The server: warm up, then fork one run per request line on stdin."""
    answers = os.fdopen(os.dup(1), "w")  # the protocol; stray prints of the imports go to stderr
    os.dup2(2, 1)
    from disttrain_core.base.startup import uncollected_imports

    with uncollected_imports():  # every run forks from here: its collections never walk the imports
        _warm_imports()
    protocol = {0, answers.fileno()}
    answers.write(json.dumps({"ready": os.getpid()}) + "\n")
    answers.flush()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run(request, protocol)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()


class Zygote:
    """The test session's side: start the server once, then ``run`` train.py through it."""

    def __init__(self) -> None:
        self.server = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.buffer = b""
        self.current: WarmProcess | None = None
        self._answer(timeout=120)  # ready

    def _answer(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        fd = self.server.stdout.fileno()
        while b"\n" not in self.buffer:
            left = max(0.0, deadline - time.monotonic())  # 0: look once without waiting (``poll``)
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the warm interpreter (tests/zygote.py) exited with {self.server.wait()}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def alive(self) -> bool:
        return self.server.poll() is None

    def start(self, script: Path, argv: list[str], cwd: Path, env: dict, stdout: Path, stderr: Path | None = None):
        """Like ``subprocess.Popen([python, script, *argv], start_new_session=True, ...)`` with output to files
        (``stderr=None``: into stdout): a ``WarmProcess`` (pid, poll, wait, send_signal). The server runs one
        at a time: wait for it before the next ``start`` or ``run``. Only train.py, which starts its fork
        server before it runs anything, gets a forked one."""
        if self.current is not None and self.current.returncode is None:  # left running by a failed test
            self.current.kill()
        request = {"script": str(script), "argv": argv, "cwd": str(cwd), "env": env}
        request["fork_server"] = Path(script).name == "train.py"
        request |= {"stdout": str(stdout), "stderr": None if stderr is None else str(stderr)}
        self.server.stdin.write((json.dumps(request) + "\n").encode())
        self.server.stdin.flush()
        self.current = WarmProcess(self, self._answer(timeout=60)["pid"], [sys.executable, str(script), *argv])
        return self.current

    def run(self, script: Path, argv: list[str], cwd: Path, env: dict, timeout: float, scratch: Path):
        """Like ``subprocess.run([python, script, *argv], capture_output=True, text=True, timeout=...)``."""
        scratch.mkdir(parents=True, exist_ok=True)
        out, err = scratch / "stdout", scratch / "stderr"
        process = self.start(script, argv, cwd, env, out, err)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired as expired:
            process.kill()
            expired.output, expired.stderr = out.read_text(), err.read_text()
            raise
        return subprocess.CompletedProcess(process.args, code, out.read_text(), err.read_text())

    def close(self) -> None:
        if self.alive():
            self.server.stdin.close()
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.server.kill()


class WarmProcess:
    """A run of the warm interpreter as ``subprocess.Popen`` shows a child: its pid (also its process group:
    the run is a session leader), ``poll``, ``wait``, ``send_signal`` and ``kill`` (the whole group)."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(1e9 if timeout is None else timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def _status(self, timeout: float) -> int | None:
        if self.returncode is None:
            done = self.zygote._answer(timeout=timeout)
            if done is not None:
                self.returncode = done["status"]
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL to the run's process group (its fork server and ranks too), then reap it."""
        import signal

        if self.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.wait(60)


if __name__ == "__main__":
    serve()
