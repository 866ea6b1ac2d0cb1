"""Before any process starts: the state a run starts from must fit the model it builds.

* ``model.init_from``: each directory has an importer and a config equal to ours, and (strict) every
  model part is covered (models/hf/).
* ``trainer.resume``: the newest checkpoint with a readable meta.json records this model's
  fingerprint (train/state.py). Damaged checkpoints are left to the run, which skips them and says why.

Each problem is one line (the exceptions below); launch/entry.py prints it and exits with status 2.
"""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from ..data.tokenizer import tokenizer_for
from ..models import build_model
from ..models.common import count_parameters
from ..models.hf import PretrainedError, check_pretrained
from .checkpoint import CheckpointMismatch, check_model, read_meta, resume_candidates
from .dcp_io import CheckpointCorrupt
from .state import model_fingerprint

STATE_ERRORS = (PretrainedError, CheckpointMismatch, FileNotFoundError)


def check_state_sources(cfg: Config, run_dir: Path) -> None:
    if cfg.model.init_from in (None, "") and cfg.trainer.resume in (None, "", "none"):
        return
    model = build_model(cfg.model, tokenizer_for(cfg), device="meta")
    if cfg.model.init_from not in (None, ""):
        check_pretrained(cfg.model, {name: count_parameters(m) for name, m in model.submodules().items()})
    for checkpoint in resume_candidates(cfg.trainer.resume, run_dir):
        try:
            meta = read_meta(checkpoint)
        except CheckpointCorrupt:
            continue  # the run skips it with a warning and tries the previous one
        check_model(checkpoint, meta, cfg.model.name, model_fingerprint(model))
        return
