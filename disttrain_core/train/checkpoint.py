"""Atomic, optionally asynchronous checkpoints.

Layout::

    checkpoints/
      step_00000100/          a complete checkpoint (the rename is the commit)
        meta.json             step, layout, versions; written last
        <files>               whatever each rank saved (model.pt, optimizer.pt, data_dp00000.json, ...)
      step_00000200.partial/  being written; never read
      latest                  name of the newest complete checkpoint

Every rank snapshots its state to CPU memory synchronously (so training can
go on mutating parameters), then writes its files -- in a background thread
when ``async_save`` is on -- and drops a ``.done.rank<r>`` marker. Rank 0
waits for all markers, writes ``meta.json``, renames the directory and
updates ``latest`` with an atomic replace. A crash at any point before the
rename leaves only a ``.partial`` directory, which the next run deletes; the
previous checkpoint stays the latest. The filesystem is the only
synchronization, so the background thread issues no collectives; multi-node
runs need a shared filesystem for the checkpoint directory, as usual.

Files load with ``torch.load(weights_only=True)``: only tensors and plain
containers are ever saved.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

PARTIAL = ".partial"


def snapshot(obj: Any) -> Any:
    """A deep copy with every tensor cloned to CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


def _write_file(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".json":
        tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    else:
        torch.save(obj, tmp)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointManager:
    def __init__(
        self,
        root: str | os.PathLike,
        rank: int,
        world_size: int,
        barrier: Callable[[], None],
        keep_last: int = 2,
        async_save: bool = True,
        commit_timeout_s: float = 600.0,
    ):
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier
        self.keep_last = keep_last
        self.async_save = async_save
        self.commit_timeout_s = commit_timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"*{PARTIAL}"):
                shutil.rmtree(stale, ignore_errors=True)
        barrier()

    # ------------------------------------------------------------------ saving
    def save(self, step: int, files: dict[str, Any], meta: dict[str, Any]) -> None:
        """Save this rank's ``files`` (name -> object) as part of checkpoint ``step``."""
        self.wait()
        partial = self.root / (step_dir_name(step) + PARTIAL)
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        self.barrier()
        payload = snapshot(files)
        job = (partial, step, payload, meta)
        if self.async_save:
            self._thread = threading.Thread(target=self._run, args=job, name="checkpoint-writer", daemon=True)
            self._thread.start()
        else:
            self._run(*job)
            self._raise_if_failed()

    def _run(self, partial: Path, step: int, payload: dict[str, Any], meta: dict[str, Any]) -> None:
        try:
            started = time.perf_counter()
            for name, obj in payload.items():
                _write_file(partial / name, obj)
            (partial / f".done.rank{self.rank}").touch()
            if self.rank == 0:
                self._commit(partial, step, meta)
                log.info("checkpoint step %d written in %.2fs", step, time.perf_counter() - started)
        except BaseException as error:  # surfaced on the training thread by wait()
            self._error = error

    def _commit(self, partial: Path, step: int, meta: dict[str, Any]) -> None:
        deadline = time.monotonic() + self.commit_timeout_s
        while len(list(partial.glob(".done.rank*"))) < self.world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint {partial}: not every rank finished writing in time")
            time.sleep(0.01)
        for marker in partial.glob(".done.rank*"):
            marker.unlink()
        _write_file(partial / "meta.json", {**meta, "step": step, "world_size": self.world_size})
        final = self.root / step_dir_name(step)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        latest_tmp = self.root / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, self.root / "latest")
        self._prune()

    def _prune(self) -> None:
        complete = sorted(p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(PARTIAL))
        for old in complete[: max(0, len(complete) - self.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)

    def wait(self) -> None:
        """Block until a pending asynchronous save has finished; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint save failed: {error}") from error

    # ----------------------------------------------------------------- loading
    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    root = Path(root)
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / "meta.json").is_file():
            return candidate
    complete = sorted(p for p in root.glob("step_*") if (p / "meta.json").is_file())
    return complete[-1] if complete else None


def resolve_resume(resume: str, run_dir: str | os.PathLike) -> Path | None:
    """Map ``trainer.resume`` to a checkpoint directory (or None to start fresh)."""
    if resume in ("none", "", None):
        return None
    if resume == "auto":
        return latest_checkpoint(Path(run_dir) / "checkpoints")
    path = Path(resume)
    if (path / "meta.json").is_file():
        return path
    for root in (path, path / "checkpoints"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise FileNotFoundError(
        f"trainer.resume={resume!r}: no complete checkpoint there; pass a checkpoint directory "
        "(containing meta.json), a run directory, or trainer.resume=auto"
    )


def load_file(checkpoint: Path, name: str) -> Any:
    path = checkpoint / name
    if path.suffix == ".json":
        return json.loads(path.read_text())
    return torch.load(path, map_location="cpu", weights_only=True)


def read_meta(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / "meta.json").read_text())
