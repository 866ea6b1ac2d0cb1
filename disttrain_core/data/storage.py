"""Shards behind URLs: ``pipe:CMD`` and the fsspec protocols (``s3://``, ``gs://``, ``http(s)://``, ``file://``).

reader.py calls in here for a shard path that is a URL (``is_url``) and keeps its own code for local paths.

* Names: a brace pattern expands as for local paths. On a protocol that lists (s3, gs, file, ...) the names
  that exist are found with one listing per directory, a glob with ``fs.glob``, and a URL of a "directory"
  (``s3://bucket/prefix/``) names its ``*.tar``. ``http(s)://`` and ``pipe:`` names are taken as given (nothing
  to list): a missing one is a ShardError when it is read, and validation checks the first.
* Opening: fsspec files seek with range requests, so reader.py's ``_Tail`` and the park/reopen at a byte offset
  work unchanged. ``pipe:`` (webdataset's ``gopen``) and files that cannot seek are read through
  ``ForwardReader``: forward seeks read and discard, a backward seek stays inside the last bytes read (tarfile
  seeks back one byte before a header); reopening a parked one there reads up to its offset again.
* Options: ``data.storage_options`` maps a protocol to fsspec options (an endpoint, anonymous access).
  ``configure`` puts them in fsspec's config (``fsspec.config.conf``) and in ``FSSPEC_<PROTOCOL>`` environment
  variables, which fsspec reads at import: every process started afterwards (ranks, the producer, decode
  workers) opens shards with the same options. Credentials come from the environment, never the config.
"""

from __future__ import annotations

import copy
import io
import json
import os
import re
import threading
from typing import Any, BinaryIO

from braceexpand import braceexpand

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
PIPE = "pipe:"
UNLISTED = ("http", "https")  # names taken as given: a web server has no listing to ask
GLOB = "*?["
TAIL_BYTES = 1 << 16  # kept behind the read position of a forward-only stream: the reach of a backward seek
# Bytes one request of a seekable URL file reads ahead (fsspec's cache): s3fs's own default, 50 MiB, held by each of
# the 16 shards a stream keeps open, in every decode worker, would be gigabytes. data.storage_options can set it.
BLOCK_BYTES = 8 << 20
PROBE_TIMEOUT_S = 8.0  # check_reachable gives up on an endpoint that has not answered by then
# Only check_reachable uses these (training keeps botocore's retries): an unreachable endpoint fails in about a
# second instead of ~9 s (measured on a closed port: 0.5 s with them, 9.4 s with botocore's defaults).
_FAST_S3 = {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 2}}
# Option names that carry credentials: they belong in the environment (the run's config is saved with it).
SECRET_OPTIONS = frozenset(
    {"key", "secret", "password", "aws_access_key_id", "aws_secret_access_key", "aws_session_token", "session_token"}
)


def is_url(path: str) -> bool:
    return path.startswith(PIPE) or _URL.match(path) is not None


def protocol(path: str) -> str:
    """``pipe``, or the URL's scheme in lower case (``s3``, ``https``, ...)."""
    match = _URL.match(path)
    return "pipe" if path.startswith(PIPE) else match.group(1).lower() if match else "file"


def shard_name(path: str) -> str:
    """The shard's file name (the prefix of its sample keys): the URL's last path component, or for ``pipe:``
    the base name of the command's last word."""
    if path.startswith(PIPE):
        words = path[len(PIPE) :].split()
        return os.path.basename(words[-1]) if words else path
    from urllib.parse import urlsplit

    return urlsplit(path).path.rstrip("/").rsplit("/", 1)[-1]


# ------------------------------------------------------------------------------------------- options
def _plain(value: Any) -> Any:
    """A config value (OmegaConf containers included) as plain dicts, lists and scalars."""
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return value
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value]


def storage_options(data_cfg) -> dict[str, dict[str, Any]]:
    """``data.storage_options`` as {protocol: options}; ValueError if it is not a mapping of mappings."""
    options = _plain(getattr(data_cfg, "storage_options", None) or {})
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise ValueError("give a mapping from a protocol to its fsspec options, e.g. {s3: {endpoint_url: URL}}")
    for proto in options:  # FSSPEC_<PROTOCOL> carries it to other processes: letters and digits only
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", proto):
            raise ValueError(f"{proto!r} is not a protocol name (s3, gs, http, https, file, ...)")
    return {proto.lower(): opts for proto, opts in options.items()}


def secret_options(options: dict[str, dict[str, Any]]) -> list[str]:
    """``protocol.name`` of each credential-like option (found at any depth)."""

    def walk(prefix: str, value: Any) -> list[str]:
        if not isinstance(value, dict):
            return []
        found = [f"{prefix}.{k}" for k in value if k.lower() in SECRET_OPTIONS]
        return found + [name for k, v in value.items() for name in walk(f"{prefix}.{k}", v)]

    return [name for proto, opts in options.items() for name in walk(proto, opts)]


_base_conf: dict[str, dict[str, Any]] | None = None  # fsspec's config before the first configure
_exported: set[str] = set()  # FSSPEC_* variables configure set


def configure(data_cfg) -> None:
    """Apply ``data.storage_options`` to fsspec in this process and, through the environment, in every process
    it starts. Idempotent; a later call replaces what an earlier one set."""
    global _base_conf
    options = storage_options(data_cfg)
    if not options and _base_conf is None:
        return  # nothing to apply, nothing applied before: fsspec is not even imported (local shards)
    import fsspec.config

    conf = fsspec.config.conf
    if _base_conf is None:
        _base_conf = copy.deepcopy(conf)
    for proto in set(conf) - set(_base_conf):
        del conf[proto]
    for proto, opts in _base_conf.items():
        conf[proto] = copy.deepcopy(opts)
    for proto, opts in options.items():
        conf[proto] = {**conf.get(proto, {}), **copy.deepcopy(opts)}
    for name in _exported - {f"FSSPEC_{proto.upper()}" for proto in options}:
        os.environ.pop(name, None)
    for proto in options:
        os.environ[f"FSSPEC_{proto.upper()}"] = json.dumps(conf[proto])
    _exported.clear()
    _exported.update(f"FSSPEC_{proto.upper()}" for proto in options)


# --------------------------------------------------------------------------------------------- names
def _url_to_fs(url: str):
    import fsspec.core

    return fsspec.core.url_to_fs(url)


def _listing(directory: str, listings: dict[str, tuple[set[str], set[str]]]) -> tuple[set[str], set[str]]:
    """(file names, subdirectory names) in a URL's directory: one listing, kept for the other names there."""
    if directory not in listings:
        try:
            fs, stripped = _url_to_fs(directory)
            entries = fs.ls(stripped, detail=True)
        except (OSError, ValueError):  # missing, not a directory: none of its shards can be read
            entries = []
        names = [(e["name"].rstrip("/").rsplit("/", 1)[-1], e.get("type")) for e in entries]
        listings[directory] = ({n for n, t in names if t == "file"}, {n for n, t in names if t == "directory"})
    return listings[directory]


def _glob(pattern: str) -> list[str]:
    """The files a glob URL matches, as URLs of the same scheme."""
    scheme = protocol(pattern)
    fs, stripped = _url_to_fs(pattern)
    try:
        matches = fs.glob(stripped, detail=True)
    except (OSError, ValueError):
        return []
    names = [name for name, info in matches.items() if info.get("type") == "file"]
    return sorted(f"{scheme}://{name if scheme == 'file' else name.lstrip('/')}" for name in names)


def _names_a_directory(pattern: str) -> bool:
    """A URL that ends with a slash, or a bare bucket (``s3://bucket``)."""
    rest = pattern.split("://", 1)[1]
    return pattern.endswith("/") or (protocol(pattern) != "file" and "/" not in rest.strip("/"))


def expand(path: str) -> tuple[list[str], list[str]]:
    """(shard URLs, names that are missing) of a URL: a file, a directory, a glob, or a brace pattern. A
    directory names its ``*.tar``; a name, glob or directory that gives no file is missing."""
    if path.startswith(PIPE) or protocol(path) in UNLISTED:
        return list(braceexpand(path)), []
    found: list[str] = []
    missing: list[str] = []
    listings: dict[str, tuple[set[str], set[str]]] = {}
    for pattern in braceexpand(path):
        matches = [pattern]
        if any(c in pattern.split("://", 1)[1] for c in GLOB):
            matches = _glob(pattern)
        elif _names_a_directory(pattern):
            matches = _glob(pattern.rstrip("/") + "/*.tar")
        else:
            directory, _, name = pattern.rpartition("/")
            files, directories = _listing(directory, listings)
            if name not in files:
                matches = _glob(pattern + "/*.tar") if name in directories else []
        found.extend(matches)
        if not matches:
            missing.append(pattern)
    return found, missing


# ------------------------------------------------------------------------------------------- reading
class ForwardReader(io.RawIOBase):
    """A stream read front to back, seen as a file: ``tell``; ``seek`` forward reads and discards, backward only
    within the last ``TAIL_BYTES`` read. Closing stops a ``pipe:`` command that has not finished."""

    def __init__(self, raw: Any):
        super().__init__()
        self.raw = raw
        self._pos = 0  # read position
        self._kept = bytearray()  # the stream's bytes [self._end - len(self._kept), self._end)
        self._end = 0  # bytes taken from raw

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True  # within the limits above (gzip, bz2 and xz readers over it seek forward only)

    def tell(self) -> int:
        return self._pos

    def _take(self, size: int) -> bytes:
        """Up to ``size`` (-1: all) more bytes of raw, fewer only at its end."""
        parts, wanted = [], size
        while wanted != 0:
            chunk = self.raw.read(wanted if wanted > 0 else 1 << 20)
            if not chunk:
                break
            parts.append(chunk)
            wanted = wanted - len(chunk) if wanted > 0 else -1
        data = b"".join(parts)
        self._end += len(data)
        if len(data) >= TAIL_BYTES:
            self._kept = bytearray(data[-TAIL_BYTES:])
        else:
            self._kept += data
            if len(self._kept) > 2 * TAIL_BYTES:
                del self._kept[: len(self._kept) - TAIL_BYTES]
        return data

    def read(self, size: int | None = -1) -> bytes:
        size = -1 if size is None else size
        kept = b""
        if self._pos < self._end:  # after a backward seek: serve what was kept first
            start = len(self._kept) - (self._end - self._pos)
            kept = bytes(self._kept[start : start + size if size >= 0 else None])
            self._pos += len(kept)
            if size >= 0:
                size -= len(kept)
            if size == 0:
                return kept
        data = self._take(size)
        self._pos += len(data)
        return kept + data if kept else data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self._pos
        elif whence != io.SEEK_SET:
            raise io.UnsupportedOperation("a forward-only stream cannot seek from its end")
        if offset < self._end - len(self._kept):
            raise OSError(f"cannot seek back to byte {offset} of a forward-only stream (at {self._pos})")
        while offset > self._end and self._take(min(offset - self._end, 1 << 20)):
            pass
        self._pos = min(offset, self._end)
        return self._pos

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        process = getattr(self.raw, "proc", None)  # webdataset's Pipe
        if process is not None and process.poll() is None:
            process.kill()  # stopped early (a parked shard): its exit status is no error
        try:
            self.raw.close()
        except Exception:  # a command's exit status after kill, a connection already gone: nothing left to read
            pass


def reopen_warning(shards: list[str], per_stream: int, max_open: int) -> str | None:
    """A line when a stream of URL shards reads more of them than it keeps open: then every sample reopens its
    shard (a new range request; ``pipe:`` runs its command again and reads up to the offset)."""
    if per_stream <= max_open or not shards or not is_url(shards[0]):
        return None
    return (
        f"this stream reads {per_stream} shards behind URLs and keeps {max_open} open: each sample reopens its shard "
        f"({'reading it again from its start' if shards[0].startswith(PIPE) else 'a new range request'}); use fewer, "
        "larger shards per data-parallel rank (docs/DATA.md, Shards behind URLs)"
    )


def open_binary(path: str) -> BinaryIO:
    """A shard URL opened for reading: seekable where the protocol allows, a ForwardReader otherwise."""
    if path.startswith(PIPE):
        from webdataset.gopen import gopen

        return ForwardReader(gopen(path, "rb"))  # type: ignore[return-value]
    import fsspec.config

    fs, stripped = _url_to_fs(path)  # as fsspec.open(path, "rb"), with a block size of our own
    options = fsspec.config.conf.get(protocol(path), {})
    chosen = "block_size" in options or "default_block_size" in options  # data.storage_options sets it
    file = fs.open(stripped, "rb", **({} if chosen else {"block_size": BLOCK_BYTES}))
    if not file.seekable() or type(file).__name__ == "HTTPStreamFile":  # fsspec's stream claims it seeks
        return ForwardReader(file)  # type: ignore[return-value]
    return file


# ---------------------------------------------------------------------------------------- validation
def _reason(error: BaseException) -> str:
    """One line for an error. fsspec raises FileNotFoundError(path) for any failure of an http request: then
    the cause says what happened (connection refused, 404)."""
    text = " ".join(str(error).split())
    if isinstance(error, FileNotFoundError) and " " not in text:  # just the path
        cause = error.__cause__ or error.__context__
        return _reason(cause) if cause is not None else "not found"
    return text[:300] or type(error).__name__


def _probe_fs(url: str):
    """The filesystem of ``url``, with short timeouts and few retries where the protocol takes them (s3)."""
    import fsspec
    import fsspec.config

    proto = protocol(url)
    kwargs: dict[str, Any] = {}
    if proto in ("s3", "s3a"):
        conf = fsspec.config.conf.get("s3", {})
        kwargs["config_kwargs"] = {**copy.deepcopy(conf.get("config_kwargs", {})), **copy.deepcopy(_FAST_S3)}
    return fsspec.filesystem(proto, skip_instance_cache=True, **kwargs)  # cached per thread: no probe left behind


def _probe(path: str, first: str) -> str | None:
    """None if the storage answers for ``first`` (the pattern's first name); else why not."""
    fs = _probe_fs(first)
    if protocol(path) in UNLISTED:
        targets = [first]  # http: the first shard itself (a server has no directories to ask)
    else:  # the first name, its directory, its bucket (root): any that is there shows the storage answers
        stripped = fs._strip_protocol(first)
        head = re.split(r"[*?[]", stripped, maxsplit=1)[0]  # the part of a glob that names directories
        directory = head.rstrip("/") if head.endswith("/") else head.rpartition("/")[0]
        root = "/" if protocol(path) == "file" else stripped.lstrip("/").split("/", 1)[0]
        targets = ([stripped] if head == stripped else []) + [t for t in (directory, root) if t]
    first_error: Exception | None = None
    for target in dict.fromkeys(targets):
        try:
            fs.info(target)
            return None
        except Exception as error:
            first_error = first_error or error
            if not isinstance(error, FileNotFoundError):  # refused, timed out, denied: asking more will not help
                break
    return _reason(first_error) if first_error is not None else None


def check_reachable(path: str) -> str | None:
    """None if a URL's storage answers (its directory, or bucket, exists; http: its first shard is there),
    else one line saying why not (connection refused, unknown bucket, 404...), within ``PROBE_TIMEOUT_S``.
    ``pipe:`` commands are not run here: a failing one is a ShardError when read. A brace pattern is expanded:
    check its size first (reader.check_name_count)."""
    if path.startswith(PIPE) or not is_url(path):
        return None
    first = next(iter(braceexpand(path)))  # unbalanced braces: braceexpand's ValueError
    result: list[str | None] = []

    def run() -> None:
        try:
            result.append(_probe(path, first))
        except Exception as error:  # a malformed URL, an unknown protocol
            result.append(_reason(error))

    probe = threading.Thread(target=run, name="storage-probe", daemon=True)
    probe.start()
    probe.join(PROBE_TIMEOUT_S)
    return result[0] if result else f"no answer within {PROBE_TIMEOUT_S:g} s"
