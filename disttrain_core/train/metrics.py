"""Metrics sinks: TensorBoard (through Fabric's logger) and ``metrics.jsonl``.

Only rank 0 writes. ``metrics.jsonl`` holds one JSON object per logged step
with at least ``step`` and ``loss``; it is appended to on resume, so a resumed
run continues the same file.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, run_dir: str | Path, enabled: bool, tensorboard: bool, jsonl: bool):
        self.enabled = enabled
        self.tensorboard = None
        self.jsonl = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        if tensorboard:
            from lightning_fabric.loggers import TensorBoardLogger

            self.tensorboard = TensorBoardLogger(root_dir=str(run_dir), name="tensorboard", version="")
        if jsonl:
            self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        if self.tensorboard is not None:
            self.tensorboard.log_metrics(clean, step=step)
        if self.jsonl is not None:
            record: dict[str, Any] = {"step": step, "loss": clean.get("train/loss"), "time": time.time()}
            record.update({k.split("/", 1)[-1] if k.startswith("train/") else k: v for k, v in clean.items()})
            self.jsonl.write(json.dumps(record) + "\n")

    def log_image(self, tag: str, image_hwc, step: int) -> None:
        if self.enabled and self.tensorboard is not None:
            self.tensorboard.experiment.add_image(tag, image_hwc, step, dataformats="HWC")

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.finalize("success")
        if self.jsonl is not None:
            self.jsonl.close()
