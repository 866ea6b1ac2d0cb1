"""Metrics sinks: ``metrics.jsonl`` and the trackers ``logger=`` chooses (train/trackers.py).

Only rank 0 writes. ``metrics.jsonl`` holds one JSON object per logged step with at least ``step`` and
``loss``; it is appended to on resume, so a resumed run continues the same file. Every tracker receives the
same scalars at the same steps, the resolved config once, and the samples (train/sampling.py).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from .trackers import build_trackers


class MetricsLogger:
    def __init__(self, run_dir: str | Path, enabled: bool, logger_cfg, config: dict | None = None):
        self.enabled = enabled
        self.trackers: list = []
        self.jsonl = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        self.trackers = build_trackers(run_dir, logger_cfg)
        if config is not None:
            for tracker in self.trackers:
                tracker.log_config(config)
        if logger_cfg.jsonl:
            self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        for tracker in self.trackers:
            tracker.log_metrics(clean, step)
        if self.jsonl is not None:
            record: dict[str, Any] = {"step": step, "loss": clean.get("train/loss"), "time": time.time()}
            record.update({k.split("/", 1)[-1] if k.startswith("train/") else k: v for k, v in clean.items()})
            self.jsonl.write(json.dumps(record) + "\n")

    def log_image(self, tag: str, image_hwc, step: int) -> None:
        for tracker in self.trackers:  # none on ranks other than 0
            tracker.log_image(tag, image_hwc, step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        for tracker in self.trackers:  # none on ranks other than 0
            tracker.log_text(tag, text, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        if self.jsonl is not None:
            self.jsonl.close()
