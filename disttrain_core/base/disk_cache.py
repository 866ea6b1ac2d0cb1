"""Results kept on disk between runs (``$DISTTRAIN_CACHE``, default ``~/.cache/disttrain``): the planner's
workloads, the FLOP counts behind MFU, and what was measured on this machine (the planner's profiles, matmul
peaks). A computed entry is a pure function of its key, which names what the value depends on (a version, the
torch release, the config, the source of the code that computes it), so any process may share it; a measured
one depends on the machine and its load as well, and lives under ``$DISTTRAIN_MEASURED_CACHE`` when that is set
(the test suite: one per pytest-xdist worker, which measure side by side). Writes are atomic (a temporary file
renamed over the entry), so processes computing the same entry side by side never read half of one; a read-only
or full disk only costs a recomputation."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any


def cache_root(measured: bool = False) -> Path:
    root = Path(os.environ.get("DISTTRAIN_CACHE", Path.home() / ".cache" / "disttrain"))
    return Path(os.environ.get("DISTTRAIN_MEASURED_CACHE", root)) if measured else root


def cache_file(kind: str, key: str) -> Path:
    """``<root>/<kind>/<sha256(key)[:24]>.json``."""
    return cache_root() / kind / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, value: Any, indent: int | None = None) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value, indent=indent))
        os.replace(tmp, path)
    except OSError:
        pass


@functools.cache
def source_digest(package_dir: str) -> str:
    """A digest of every ``.py`` file under ``package_dir``: a key part that changes whenever the code that
    computed a cached value might have."""
    digest = hashlib.sha256()
    for path in sorted(Path(package_dir).rglob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
