"""The one exception a sample reader raises for a sample it must skip (and count by reason)."""

from __future__ import annotations


class BadSample(Exception):
    """A sample that must be skipped; ``reason`` is a short counter name."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class UnusableRow:
    """A stream element its reader already knows cannot be used (data/hf_source.py: a row whose mapped column is
    missing, None or of the wrong type): the loader skips and counts it under ``reason`` without decoding."""

    def __init__(self, key: str, reason: str, detail: str = ""):
        self.key, self.reason, self.detail = key, reason, detail
