"""The one exception a sample reader raises for a sample it must skip (and count by reason)."""

from __future__ import annotations


class BadSample(Exception):
    """A sample that must be skipped; ``reason`` is a short counter name."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
