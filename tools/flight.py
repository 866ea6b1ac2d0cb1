"""Name the rank and the operation where a stopped job's ranks diverged, from its flight recorder dumps.

    python tools/flight.py outputs/run            # or its flight/ directory, or path=...

Each training process writes ``<run dir>/flight/rank<R>.json`` when it fails, times out or is
signalled (disttrain_core/comm/flight.py). The ranks of a process group enter its collectives in
the same order, so the rank whose last collective on a group is behind the others' is the one that
never entered the next one; the pipeline broker's transfers and the ring threads' jobs are
compared the same way (sends against the peer's receives). The earliest divergence comes first;
that is usually the cause, the rest its consequences. Exit 0 with the diagnosis, 2 when the
directory holds no dump. docs/FLIGHT.md explains the records.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from pathlib import Path

from disttrain_core.comm.flight import FLIGHT_DIR, P2P_KINDS, read_dumps
from disttrain_core.launch.cli import split_tool_args, tool_main
from disttrain_core.validation import ConfigError

OPTIONS = {"path": "", "max": "5"}


def clock(ns: int | None) -> str:
    if not ns:
        return "?"
    return time.strftime("%H:%M:%S", time.localtime(ns / 1e9)) + f".{int(ns % 1_000_000_000) // 1_000_000:03d}"


def place(frame) -> str:
    if not frame:
        return "?"
    path, line, function = frame
    relative = os.path.relpath(path)
    return f"{path if relative.startswith('..') else relative}:{line} {function}"


def operations(dump: dict) -> list[dict]:
    """A rank's operations from both recorders, as ``{stream, n, kind, group, posted, done, thread}``."""
    rank, out = dump["rank"], []
    for entry in dump.get("torch", {}).get("entries", []):
        if entry.get("p2p") or not entry.get("n"):
            continue  # torch's point-to-point entries (NCCL) carry no peer: not compared
        done = entry.get("state") in ("completed", "stream-waited") or bool(entry.get("retired"))
        out.append({**entry, "stream": ("torch", entry["group"]), "done": done, "thread": None})
    for record in dump.get("records", []):
        entry = {
            **record,
            "done": record["state"] in ("completed", "stream-waited"),
            "failed": record["state"] == "failed",
        }
        if record["kind"] in P2P_KINDS:
            peer = record["peers"][0] if record["peers"] else None
            source, target = (rank, peer) if record["kind"] == "send" else (peer, rank)
            entry["stream"] = ("p2p", record["group"], source, target)
        else:
            entry["stream"] = ("ring", record["group"])
        out.append(entry)
    return out


def describe_group(name: str, groups: dict) -> str:
    group = groups.get(name, {})
    desc = group.get("desc") or ""
    text = f"process group {name}" + (f" '{desc}'" if desc and desc != "undefined" else "")
    return text + (f", ranks {group['ranks']}" if group.get("ranks") is not None else "")


def describe_op(op: dict, groups: dict) -> str:
    stream = op["stream"]
    if stream[0] == "p2p":
        _, group, source, target = stream
        way = f"to rank {target}" if op["kind"] == "send" else f"from rank {source}"
        return f"{op['kind']} #{op['n']} {way} (process group {group})"
    return f"{op['kind']} #{op['n']} ({describe_group(stream[1], groups)})"


def ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Job:
    def __init__(self, dumps: dict[int, dict]):
        self.dumps = dumps
        self.groups: dict[str, dict] = {}
        for dump in dumps.values():
            for name, group in dump.get("groups", {}).items():
                self.groups.setdefault(name, group)
        self.ops = {rank: operations(dump) for rank, dump in dumps.items()}
        self.by_stream: dict[tuple, dict[int, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
        for rank, ops in self.ops.items():
            for op in ops:
                self.by_stream[op["stream"]][rank][op["n"]] = op
        sizes = [d.get("world_size") or 0 for d in dumps.values()]
        members = {r for g in self.groups.values() for r in g.get("ranks") or []}
        self.world = set(range(max(sizes + [0]))) | members | set(dumps)
        self.missing = sorted(self.world - set(dumps))

    def members(self, stream: tuple) -> list[int]:
        ranks = self.groups.get(stream[1], {}).get("ranks")
        return sorted(ranks) if ranks else sorted(self.by_stream[stream])

    def last(self, stream: tuple, rank: int) -> int:
        return max(self.by_stream[stream].get(rank, {}) or [0])

    def findings(self) -> list[dict]:
        found = []
        for stream in sorted(self.by_stream, key=str):
            found += self.p2p(stream) if stream[0] == "p2p" else self.collective(stream)
        return sorted(found, key=lambda f: (f["time"] or 0, f["rank"] if f["rank"] is not None else -1))

    def collective(self, stream: tuple) -> list[dict]:
        present = [r for r in self.members(stream) if r in self.dumps]
        last = {r: self.last(stream, r) for r in present}
        if not last:
            return []
        top, found = max(last.values()), []
        for rank in present:
            if last[rank] >= top:
                continue
            wanted = last[rank] + 1
            entered = {q: self.by_stream[stream][q][wanted] for q in present if wanted in self.by_stream[stream][q]}
            leaders = [q for q in present if last[q] >= wanted]
            sample = next(iter(entered.values()), {"kind": "operation", "n": wanted, "stream": stream})
            when = min((op.get("posted") or 0 for op in entered.values()), default=0) or None
            text = (
                f"rank {rank} never entered {describe_op(sample, self.groups)} that {ranks_text(leaders)}"
                f" entered at {clock(when)}"
            )
            found.append({"time": when, "rank": rank, "text": text + self.context(rank, stream)})
        missing = [r for r in self.members(stream) if r not in self.dumps]
        waiting = {q: self.by_stream[stream][q].get(top) for q in present}
        waiting = {q: op for q, op in waiting.items() if op is not None and not op["done"]}
        if missing and waiting:
            op = next(iter(waiting.values()))
            text = (
                f"{ranks_text(waiting)} entered {describe_op(op, self.groups)} at {clock(op.get('posted'))} and"
                f" never completed it; no dump from {ranks_text(missing)}, which may never have entered it"
            )
            found.append({"time": op.get("posted"), "rank": missing[0], "text": text})
        elif not found and waiting:
            op = next(iter(waiting.values()))
            text = (
                f"every rank of {describe_group(stream[1], self.groups)} entered {op['kind']} #{top}; it never"
                f" completed on {ranks_text(waiting)} (stuck inside it)"
            )
            found.append({"time": op.get("posted"), "rank": None, "text": text})
        return found + self.mismatch(stream, present)

    def mismatch(self, stream: tuple, present: list[int]) -> list[dict]:
        """The first sequence number that ranks recorded as different operations (a desynchronized group)."""
        common = set.intersection(*(set(self.by_stream[stream].get(r, {})) for r in present)) if present else set()
        for n in sorted(common):
            kinds = {r: self.by_stream[stream][r][n]["kind"] for r in present}
            if len(set(kinds.values())) > 1:
                op = self.by_stream[stream][present[0]][n]
                listed = "; ".join(f"rank {r}: {k}" for r, k in sorted(kinds.items()))
                text = f"ranks disagree on operation #{n} of {describe_group(stream[1], self.groups)}: {listed}"
                return [{"time": op.get("posted"), "rank": None, "text": text}]
        return []

    def p2p(self, stream: tuple) -> list[dict]:
        _, group, source, target = stream
        if source not in self.dumps or target not in self.dumps:
            present, absent = (source, target) if source in self.dumps else (target, source)
            waiting = [op for op in self.by_stream[stream].get(present, {}).values() if not op["done"]]
            if present not in self.dumps or not waiting:
                return []
            op = min(waiting, key=lambda o: o["n"])
            text = (
                f"rank {present} posted {describe_op(op, self.groups)} at {clock(op.get('posted'))} and it never"
                f" completed; no dump from rank {absent}"
            )
            return [{"time": op.get("posted"), "rank": absent, "text": text}]
        sends, receives = self.by_stream[stream].get(source, {}), self.by_stream[stream].get(target, {})
        sent, received = max(sends or [0]), max(receives or [0])
        if sent > received:
            op = sends[received + 1] if received + 1 in sends else sends[sent]
            text = (
                f"rank {target} never posted receive #{received + 1} from rank {source} (process group {group})"
                f" that rank {source} sent at {clock(op.get('posted'))}"
            )
            return [{"time": op.get("posted"), "rank": target, "text": text + self.context(target, stream)}]
        if received > sent:
            op = receives[sent + 1] if sent + 1 in receives else receives[received]
            text = (
                f"rank {source} never sent #{sent + 1} to rank {target} (process group {group}) that rank {target}"
                f" has waited for since {clock(op.get('posted'))}"
            )
            return [{"time": op.get("posted"), "rank": source, "text": text + self.context(source, stream)}]
        stuck = [op for op in (sends.get(sent), receives.get(received)) if op is not None and not op["done"]]
        if stuck:
            text = f"transfer #{sent} from rank {source} to rank {target} (process group {group}) never completed"
            return [{"time": stuck[0].get("posted"), "rank": None, "text": text}]
        return []

    def context(self, rank: int, stream: tuple) -> str:
        """A lagging rank's last completed operations (on the stream, anywhere) and where its threads were."""
        done = [op for op in self.ops[rank] if op["done"]]
        here = [op for op in done if op["stream"] == stream]
        text = ""
        if here:
            here = [max(here, key=lambda o: o["n"])]
            text += f"; its last completed operation there was {here[-1]['kind']} #{here[-1]['n']}"
        if done:
            latest = max(done, key=lambda o: o.get("end") or o.get("posted") or 0)
            if not here or latest is not here[-1]:
                text += f"; its last completed operation {'anywhere ' if here else ''}was"
                text += f" {describe_op(latest, self.groups)}"
        dump = self.dumps[rank]
        text += f"; its main thread was in {place(dump.get('where'))}"
        busy = {op["thread"] for op in self.ops[rank] if op.get("thread") and not op["done"]} - {"MainThread"}
        for thread in dump.get("threads", []):
            if thread["name"] in busy and thread["stack"]:
                text += f"; its thread {thread['name']} was in {place(thread['stack'][-1])}"
        return text


def diagnose(directory: Path, limit: int = 5) -> list[str]:
    """The diagnosis, line by line (raises ConfigError when there is no dump)."""
    dumps = read_dumps(directory)
    if not dumps:
        raise ConfigError(f"{directory}: no flight recorder dumps ({FLIGHT_DIR}/rank<R>.json)")
    job = Job(dumps)
    lines = [f"flight recorder: dumps of {ranks_text(dumps)} ({len(dumps)} of {len(job.world)})"]
    if job.missing:
        lines.append(f"no dump from {ranks_text(job.missing)} (killed before it could write one?)")
    for rank, dump in sorted(dumps.items()):
        reasons = "; then ".join(f"{r['reason'].splitlines()[0][:160]} ({clock(r['time'])})" for r in dump["reasons"])
        torch_note = "" if dump.get("torch", {}).get("available") else " [no torch recorder entries]"
        lines.append(f"  rank {rank}: {reasons}{torch_note}")
    findings = job.findings()
    if not findings:
        lines.append("no divergence: every rank entered the same operations, and all of them completed")
        return lines
    lines.append(findings[0]["text"])
    if len(findings) > 1:
        lines.append(f"then ({len(findings) - 1} more, probably consequences):")
        lines += [f"  {f['text']}" for f in findings[1:limit]]
    return lines


def main(argv: list[str]) -> int:
    options, rest = split_tool_args(argv, OPTIONS)
    positional = [a for a in rest if "=" not in a]
    if len(positional) > 1 or len(positional) < len(rest) or not (options["path"] or positional):
        print(__doc__)
        return 2
    directory = Path(options["path"] or positional[0])
    if not directory.is_dir():
        raise ConfigError(f"{directory}: not a directory")
    for line in diagnose(directory, int(options["max"])):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
