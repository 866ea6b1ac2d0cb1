"""``trainer.replan_on_failure``: a job that loses a device goes on, re-planned for the devices that remain.

With ``parallel=auto`` on one machine, when a rank dies (``RankFailed`` naming it) its device is left out
(``CUDA_VISIBLE_DEVICES`` loses it on CUDA), the orchestration solver plans the model again for the devices that
remain -- units, their data/tensor/pipeline sizes, the schedule -- and the job restarts in that layout from its
latest checkpoint: DCP reshards every unit's state into the new layout, and the data position (the global
stream every multi-unit layout reads) continues where the checkpoint stood. The plan each loss led to is kept
(``plan.json`` is the current one, ``plan.<devices>dev.json`` the earlier ones) and every re-plan is recorded in
``replans.json``. Devices that come back are not taken again until the next start of the job.

This is a restart of every rank from the last checkpoint in a new layout, not the live recovery of
``trainer.fault_tolerance`` (docs/FAULT_TOLERANCE.md says why each unit is not a replica group yet).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from pathlib import Path

from .launchers import RankFailed

log = logging.getLogger("disttrain")


def _visible_devices(count: int) -> list[str]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return listed.split(",")[:count] if listed else [str(i) for i in range(count)]


def _checkpoint_step(run_dir: Path) -> int | None:
    from ..train.checkpoint import latest_checkpoint, read_meta

    found = latest_checkpoint(run_dir / "checkpoints")
    return None if found is None else int(read_meta(found)["step"])


def start_replanning(run, container: dict, start, resolve, run_dir: str) -> None:
    """``start(run)`` until it ends without a rank's failure; after each failure that names its rank, up to
    ``trainer.replan_on_failure`` times, ``resolve(container)`` plans the devices that remain and the job starts
    again in that layout. ``container``: the job's config as composed (``parallel=auto``)."""
    budget, directory = run.cfg.trainer.replan_on_failure, Path(run_dir)
    devices = _visible_devices(run.cfg.trainer.devices)
    replans: list[dict] = []
    while True:
        try:
            start(run)
            return
        except RankFailed as failure:
            if len(replans) >= budget or failure.rank is None or len(devices) <= 1:
                raise
            lost = devices.pop(failure.rank)  # one node: rank r ran on the r-th visible device
            if run.accelerator == "cuda":
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
            step = _checkpoint_step(directory)
            log.warning(
                "%s: device %s is left out; re-planning for %d device(s) and resuming from %s "
                "(trainer.replan_on_failure: %d of %d)",
                failure,
                lost,
                len(devices),
                f"step {step}" if step is not None else "the start (no checkpoint yet)",
                len(replans) + 1,
                budget,
            )
            plan = directory / "plan.json"
            if plan.is_file():  # the plan the job ran with until now
                plan.replace(directory / f"plan.{run.cfg.trainer.devices}dev.json")
            container = copy.deepcopy(container)
            container["trainer"].update(devices=len(devices), resume="auto")
            run = resolve(container)
            replans.append(
                {
                    "time": time.time(),
                    "failure": str(failure),
                    "lost_rank": failure.rank,
                    "lost_device": lost,
                    "devices": len(devices),
                    "resumed_from_step": step,
                    "units": {u.name: [u.dp, u.tp, u.pp] for u in run.layout.units},
                }
            )
            (directory / "replans.json").write_text(json.dumps(replans, indent=1))
