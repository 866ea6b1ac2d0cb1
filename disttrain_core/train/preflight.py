"""Before any process starts: the state a run starts from must fit the model it builds.

* ``model.init_from``: each directory has an importer and a config equal to ours, and (strict) every
  model part is covered (models/hf/).
* ``trainer.resume``: the newest checkpoint with a readable meta.json records this model's
  fingerprint (train/state.py). Damaged checkpoints are left to the run, which skips them and says why.

Each problem is one line (the exceptions below); launch/entry.py prints it and exits with status 2.
"""

from __future__ import annotations

from pathlib import Path

from ..base.launch_env import requeued
from ..config import Config
from ..data.tokenizer import tokenizer_for
from ..models import build_model
from ..models.common import count_parameters
from ..models.hf import PretrainedError, check_pretrained
from .checkpoint import CheckpointMismatch, check_model, read_meta, resume_candidates
from .dcp_io import CheckpointCorrupt
from .state import model_fingerprint

STATE_ERRORS = (PretrainedError, CheckpointMismatch, FileNotFoundError)


def check_requeued_resume(cfg: Config, run_dir: Path) -> None:
    """A job SLURM requeued (``trainer.resume=auto``) must find its first run: a checkpoint, or at least the
    metrics that run wrote (it may have ended before its first checkpoint: then it starts over, as it would)."""
    restarts = requeued()
    if cfg.trainer.resume != "auto" or restarts == 0 or resume_candidates("auto", run_dir):
        return
    if not (Path(run_dir) / "checkpoints").exists() and not (Path(run_dir) / "metrics.jsonl").exists():
        raise FileNotFoundError(
            f"this job was requeued (SLURM_RESTART_COUNT={restarts}) but its run directory {run_dir} has no "
            "checkpoints/ and no metrics of the first run: put the run directory on storage every node sees "
            "(hydra.run.dir), or pass trainer.resume=<the first run's directory>"
        )


def check_state_sources(cfg: Config, run_dir: Path) -> None:
    check_requeued_resume(cfg, run_dir)
    initial = cfg.trainer.checkpoint.initial_load
    if cfg.model.init_from in (None, "") and cfg.trainer.resume in (None, "", "none") and not initial:
        return
    model = build_model(cfg.model, tokenizer_for(cfg), device="meta")
    if cfg.model.init_from not in (None, ""):
        check_pretrained(cfg.model, {name: count_parameters(m) for name, m in model.submodules().items()})
    sources = [resume_candidates(cfg.trainer.resume, run_dir)]
    if initial:  # another run's weights: its checkpoints must hold this model (read only when this run has none)
        try:
            sources.append(resume_candidates(str(initial), run_dir))
        except FileNotFoundError as error:
            raise FileNotFoundError(str(error).replace("trainer.resume=", "trainer.checkpoint.initial_load=")) from None
    for found in sources:
        for checkpoint in found:
            try:
                meta = read_meta(checkpoint)
            except CheckpointCorrupt:
                continue  # the run skips it with a warning and tries the previous one
            check_model(checkpoint, meta, cfg.model.name, model_fingerprint(model))
            break
