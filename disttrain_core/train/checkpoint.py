"""Sharded, verified, atomic checkpoints in torch.distributed.checkpoint (DCP) format.

Layout::

    checkpoints/
      step_00000100/          a complete checkpoint (the rename is the commit)
        .metadata             DCP's index of every chunk
        __<r>_0.distcp        what rank r wrote: only its own shards (DTensor / FSDP2 / ZeRO-1 chunks,
                              its stages' and unit's parameters); replicated tensors are written once
        trainer.json          step
        data_*.json           data positions (one per data-parallel replica stream, or the global one)
        meta.json             written last: step, layout, the model's fingerprint, and the SHA-256 and
                              size of every file above, computed while writing
      step_00000200.partial/  being written; never read
      latest                  name of the newest complete checkpoint

Saving: every rank hands DCP its state (parameters, optimizer state) keyed by parameter name --
never by wrapper, unit or stage, so any layout reads any other (train/state.py). With
``async_save`` DCP copies this rank's shards to host memory (one staging copy, nothing gathered)
and writes them from a background thread; the collectives DCP needs (planning, the final
metadata) run on a process group of their own (the rule of docs/COMM.md), so they never queue
behind training's. Each rank then drops a ``.done.rank<r>`` marker listing its files' digests;
rank 0 waits for all markers, writes ``meta.json``, renames the directory and replaces
``latest`` atomically. A crash before the rename leaves only a ``.partial`` directory, which the
next run deletes; the previous checkpoint stays the latest.

Loading (:func:`candidates`, :meth:`CheckpointManager.load`): newest complete checkpoint first.
Each rank verifies the files it reads against ``meta.json`` (train/dcp_io.py); a checkpoint with a
missing ``meta.json``, a truncated or altered file is skipped with a warning naming the reason,
and the previous one is tried.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..base.faults import inject
from .dcp_io import CheckpointCorrupt, ChecksumWriter, VerifyingReader, check_file

log = logging.getLogger(__name__)
# ZeRO-1 chunks travel as ShardedTensors (parallel/flat_chunks.py); DCP warns on each use that torch is
# deprecating the type. Said once in the docs, not on every save.
warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning)
# Single-process runs pass no_dist=True; DCP still says it assumes a single process.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

PARTIAL = ".partial"
FORMAT = "disttrain-dcp-1"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _write_json(path: Path, obj: Any) -> dict:
    """Write ``obj`` as JSON atomically; returns its digest record."""
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


class CheckpointManager:
    def __init__(
        self,
        root: str | os.PathLike,
        rank: int,
        world_size: int,
        barrier: Callable[[], None],
        keep_last: int = 2,
        async_save: bool = True,
        process_group=None,
        commit_timeout_s: float = 600.0,
        clean_partials: bool = True,
    ):
        """``clean_partials``: remove what a crashed save left (``.partial`` directories); not where another
        process may be saving into the same directory now (a replacement replica group, train/fault_tolerance)."""
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier
        self.keep_last = keep_last
        self.async_save = async_save
        self.group = process_group
        self.no_dist = not dist.is_initialized()
        self.commit_timeout_s = commit_timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"*{PARTIAL}") if clean_partials else ():
                shutil.rmtree(stale, ignore_errors=True)
        barrier()

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: dict[str, Any], files: dict[str, Any], meta: dict[str, Any]) -> None:
        """Checkpoint ``step``: ``state`` (DCP state dict of this rank) and ``files`` (name -> JSON object)."""
        self.wait()
        partial = self.root / (step_dir_name(step) + PARTIAL)
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        self.barrier()
        writer = ChecksumWriter(partial)
        options = {"storage_writer": writer, "process_group": self.group, "no_dist": self.no_dist}
        if self.async_save:
            future = dcp.async_save(state, **options)  # stages a host copy of this rank's shards, then returns
            job = (partial, step, files, meta, writer, future)
            self._thread = threading.Thread(target=self._run, args=job, name="checkpoint-writer", daemon=True)
            self._thread.start()
        else:
            dcp.save(state, **options)
            self._run(partial, step, files, meta, writer, None)
            self.wait()  # a failure is raised on every rank together

    def _run(self, partial: Path, step: int, files: dict, meta: dict, writer: ChecksumWriter, future) -> None:
        try:
            started = time.perf_counter()
            if future is not None:
                future.result()
            inject("save", self.rank, step)  # fault drills: this rank's shards are written, its marker is not
            digests = writer.digests()
            for name, obj in files.items():
                digests[name] = _write_json(partial / name, obj)
            _write_json(partial / f".done.rank{self.rank}.json", digests)
            if self.rank == 0:
                self._commit(partial, step, meta)
                log.info("checkpoint step %d written in %.2fs", step, time.perf_counter() - started)
        except BaseException as error:  # surfaced on the training thread by wait()
            self._error = error

    def _commit(self, partial: Path, step: int, meta: dict[str, Any]) -> None:
        deadline = time.monotonic() + self.commit_timeout_s
        while len(list(partial.glob(".done.rank*.json"))) < self.world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint {partial}: not every rank finished writing in time")
            time.sleep(0.01)
        records: dict[str, dict] = {}
        for marker in sorted(partial.glob(".done.rank*.json")):
            records.update(json.loads(marker.read_text()))
            marker.unlink()
        meta = {**meta, "format": FORMAT, "step": step, "world_size": self.world_size, "files": records}
        _write_json(partial / "meta.json", meta)
        final = self.root / step_dir_name(step)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for pointer in ("latest", "best") if "best" in meta else ("latest",):  # best: trainer.checkpoint.keep_best
            (self.root / f"{pointer}.tmp").write_text(final.name)
            os.replace(self.root / f"{pointer}.tmp", self.root / pointer)
        self._prune()

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` checkpoints, and the one ``best`` names."""
        best = (self.root / "best").read_text().strip() if (self.root / "best").is_file() else None
        complete = sorted(_step_dirs(self.root))
        for old in complete[: max(0, len(complete) - self.keep_last)]:
            if old.name != best:
                shutil.rmtree(old, ignore_errors=True)

    def supersede_after(self, step: int) -> list[str]:
        """A run that resumed from ``step`` while newer checkpoints exist (a fallback past damaged ones, or a
        rollback) continues a different history: rank 0 renames the newer ones ``<name>.superseded`` (kept,
        never read or pruned), so ``latest``, pruning and the next ``resume=auto`` follow this run. Returns
        their names; call on every rank (a barrier follows)."""
        moved = []
        if self.rank == 0:
            for path in _step_dirs(self.root):
                if int(path.name[len("step_") :]) > step:
                    target, index = path.with_name(path.name + ".superseded"), 1
                    while target.exists():  # superseded before, by an earlier fallback
                        index += 1
                        target = path.with_name(f"{path.name}.superseded{index}")
                    path.rename(target)
                    moved.append(path.name)
            pointer = self.root / "latest"
            if moved and pointer.is_file():
                pointer.unlink()
        self.barrier()
        return moved

    def wait(self) -> None:
        """Block until a pending asynchronous save has finished; re-raise its error -- on every rank, when any
        rank's save failed (a collective: every rank calls it at the same point, before the next save and at
        the end), so no rank waits for the others in the next save's barrier."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        problem = None if self._error is None else str(self._error)
        if problem is not None:  # every rank's own cause in the job's log, whichever rank reports first
            log.error("checkpoint save failed on rank %d: %s", self.rank, problem)
        if self.agree(problem) == OK:
            return
        if self._error is None:
            raise RuntimeError("checkpoint save failed on another rank (its log says why)")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint save failed: {error}") from error

    # ----------------------------------------------------------------- loading
    def load(self, checkpoint: Path, state: dict[str, Any], meta: dict[str, Any]) -> list[str]:
        """Load ``state`` in place from ``checkpoint`` (a collective). Model entries (``model.*``) must all be
        present; optimizer entries the checkpoint lacks are left as they are and returned. Every rank
        raises the same kind of error, so all fall back (or stop) together."""
        reader = VerifyingReader(checkpoint, meta["files"])
        problem, code = None, OK
        try:
            saved = set(reader.read_metadata().state_dict_metadata)
        except CheckpointCorrupt as error:
            problem, code, saved = str(error), CORRUPT, set()
        except Exception as error:  # an unreadable index after a matching digest: report, do not trace
            problem, code, saved = f".metadata unreadable: {error}", CORRUPT, set()
        missing_model = sorted(k for k in state if k.startswith("model.") and k not in saved)
        if code == OK and missing_model:
            problem, code = (
                f"checkpoint {checkpoint} lacks {len(missing_model)} parameter(s) of this model, e.g. "
                f"{missing_model[0][len('model.') :]!r}",
                MISMATCH,
            )
        agreed = self.agree(problem, code)
        if agreed == MISMATCH:
            raise CheckpointMismatch(problem or f"checkpoint {checkpoint} does not hold this model (another rank)")
        if agreed == CORRUPT:
            raise CheckpointCorrupt(problem or "another rank could not read this checkpoint")
        absent = sorted(k for k in state if k not in saved)
        wanted = {k: v for k, v in state.items() if k in saved}
        try:
            dcp.load(wanted, storage_reader=reader, process_group=self.group, no_dist=self.no_dist)
        except (Exception, CheckpointException) as error:  # DCP's exception derives from BaseException
            _reset_optimizer_entries(state)  # partly loaded: the fallback must not inherit stale moments
            raise CheckpointCorrupt(_first_failure(error)) from error
        return absent

    def agree(self, problem: str | None, code: int | None = None) -> int:
        """The worst outcome over all ranks (``OK`` < ``CORRUPT`` < ``MISMATCH``); ``problem`` without a
        ``code`` counts as ``CORRUPT``. A small all-reduce on the checkpoint group: call on every rank."""
        mine = code if code is not None else (OK if problem is None else CORRUPT)
        if self.no_dist:
            return mine
        import torch

        flag = torch.tensor([mine], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())


OK, CORRUPT, MISMATCH = 0, 1, 2


def _reset_optimizer_entries(state: dict[str, Any]) -> None:
    """Zero the ``optim.*`` tensors of ``state`` in place (fresh AdamW state: zero moments, step 0)."""
    import torch

    with torch.no_grad():
        for key, value in state.items():
            if not key.startswith("optim."):
                continue
            if hasattr(value, "local_shards"):
                for shard in value.local_shards():
                    shard.tensor.zero_()
            elif hasattr(value, "to_local"):
                value.to_local().zero_()
            else:
                value.zero_()


class CheckpointMismatch(ValueError):
    """A checkpoint of another model (or an incomplete one): resuming it would be wrong, not just unlucky."""


def check_model(checkpoint: Path, meta: dict[str, Any], name: str, fingerprint: str) -> None:
    """Raise :class:`CheckpointMismatch` unless ``meta`` records the model being resumed."""
    saved = meta.get("model", {})
    if saved.get("fingerprint") != fingerprint:
        raise CheckpointMismatch(
            f"checkpoint {checkpoint} holds model {saved.get('name')!r} (fingerprint {saved.get('fingerprint')}), "
            f"this run builds model {name!r} (fingerprint {fingerprint}); resume with the model it was trained "
            "with, or start fresh with trainer.resume=none"
        )


def _first_failure(error: BaseException) -> str:
    """The first rank's reason inside DCP's CheckpointException (which wraps every rank's failure)."""
    failures = getattr(error, "failures", None)
    if failures:
        rank, failure = sorted(failures.items())[0]
        original = failure[0] if isinstance(failure, tuple) else failure
        return f"{original} (rank {rank})"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def read_meta(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / "meta.json"
    if not path.is_file():
        raise CheckpointCorrupt("meta.json is missing (an interrupted or foreign directory)")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointCorrupt(f"meta.json unreadable: {error}") from error
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointCorrupt(f"meta.json is not a {FORMAT} checkpoint (format {found!r})")
    files = meta.get("files")
    well_formed = isinstance(files, dict) and all(
        isinstance(r, dict) and isinstance(r.get("sha256"), str) and isinstance(r.get("size"), int)
        for r in files.values()
    )
    if not well_formed or not isinstance(meta.get("step"), int) or not isinstance(meta.get("model", {}), dict):
        raise CheckpointCorrupt("meta.json is damaged (its file records, step or model entry are malformed)")
    return meta


def read_json(checkpoint: Path, name: str, meta: dict[str, Any]) -> Any:
    """A small JSON file of the checkpoint, verified against meta.json first."""
    check_file(checkpoint / name, meta["files"].get(name))
    return json.loads((checkpoint / name).read_text())


def candidates(root: str | os.PathLike) -> list[Path]:
    """Checkpoint directories under ``root``, newest first (``latest`` first when it names one); a
    directory without meta.json is listed too, so that loading says why it is skipped."""
    root = Path(root)
    found = sorted(_step_dirs(root), reverse=True)
    pointer = root / "latest"
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in found:
            found.remove(named)
            found.insert(0, named)
    return found


def _step_dirs(root: Path) -> list[Path]:
    """``step_<8 digits>`` directories: not ``.partial`` ones being written, not ``.superseded`` ones."""
    return [p for p in Path(root).glob("step_*") if p.is_dir() and re.fullmatch(r"step_\d{8}", p.name)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest checkpoint with a meta.json (no verification; tools and tests)."""
    for path in candidates(root):
        if (path / "meta.json").is_file():
            return path
    return None


def resume_candidates(resume: str, run_dir: str | os.PathLike) -> list[Path]:
    """``trainer.resume`` as checkpoint directories to try in order (empty: start fresh)."""
    if resume in ("none", "", None):
        return []
    if resume == "auto":
        return candidates(Path(run_dir) / "checkpoints")
    path = Path(resume)
    if (path / "meta.json").is_file():
        return [path]
    for root in (path, path / "checkpoints"):
        found = candidates(root)
        if found:
            return found
    raise FileNotFoundError(
        f"trainer.resume={resume!r}: no checkpoint there; pass a checkpoint directory "
        "(containing meta.json), a run directory, or trainer.resume=auto"
    )


def read_tensors(checkpoint: Path, prefix: str = "model.") -> dict[str, Any]:
    """Full tensors of a checkpoint whose keys start with ``prefix`` (prefix removed), verified, read in this
    one process: for tools and tests (a full copy of each: not for models larger than host memory)."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = read_meta(checkpoint)
    metadata = VerifyingReader(checkpoint, meta["files"]).read_metadata()
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=VerifyingReader(checkpoint, meta["files"]), no_dist=True)
    return {key[len(prefix) :]: value for key, value in state.items()}
