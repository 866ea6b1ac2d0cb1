"""The held-out loss of a checkpoint: the numbers a run logs at its validation steps (docs/EVALUATION.md).

    python tools/evaluate.py path=outputs/run                      # its newest checkpoint, on its data.val
    python tools/evaluate.py path=outputs/run/checkpoints/step_00000010 trainer.devices=1
    python tools/evaluate.py path=outputs/pp2_run parallel=dp schedule=none trainer.devices=1 data.val.path=...

``path`` is a checkpoint, a ``checkpoints/`` directory or a run directory (its newest checkpoint). The run's
own command-line overrides (``<run>/.hydra/overrides.yaml``, which ``train.py`` writes) rebuild its config;
those given here replace theirs key by key, so a checkpoint written by one layout is evaluated in another
(loaded by name and resharded, as ``trainer.resume`` does). The model is evaluated once on ``data.val`` with
``trainer.val_batches`` global batches, through ``train.py``'s launcher (``trainer.eval_only=true``), in a run
directory of its own (``out``, default ``<run>/eval/step_<N>``). Prints one JSON line: the step and the metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from disttrain_core.launch.cli import split_tool_args, tool_main
from disttrain_core.validation import ConfigError

OPTIONS = {"path": "", "out": ""}
# Overrides of the run that describe where and how it ran, not the model and data it evaluates
DROPPED = ("hydra.", "paths.output_dir", "trainer.resume", "trainer.max_steps", "trainer.exit_after_step")


def _run_overrides(run_dir: Path, given: list[str]) -> list[str]:
    """The run's command-line overrides without the keys ``given`` sets and those in DROPPED."""
    import yaml

    saved = run_dir / ".hydra" / "overrides.yaml"
    if not saved.is_file():
        return []
    keys = {o.split("=", 1)[0].lstrip("+~") for o in given}
    kept = []
    for override in yaml.safe_load(saved.read_text()) or []:
        key = override.split("=", 1)[0].lstrip("+~")
        if key not in keys and not key.startswith(DROPPED):
            kept.append(override)
    return kept


def main(argv: list[str]) -> int:
    from disttrain_core.config import compose
    from disttrain_core.launch.entry import launch
    from disttrain_core.train.checkpoint import read_meta, resume_candidates

    options, overrides = split_tool_args(argv, OPTIONS)
    if not options["path"]:
        raise ConfigError("path=<checkpoint, checkpoints/ or run directory> is required")
    try:
        checkpoint = resume_candidates(options["path"], ".")[0].resolve()  # the newest, as trainer.resume takes it
    except FileNotFoundError as error:
        raise ConfigError(str(error).replace("trainer.resume=", "path=")) from None
    run_dir = checkpoint.parent.parent
    step = int(read_meta(checkpoint)["step"])
    out = Path(options["out"] or run_dir / "eval" / f"step_{step:08d}")
    if (out / "metrics.jsonl").exists():
        raise ConfigError(f"out={out} holds an evaluation already: name another directory")
    cfg = compose(
        [
            *_run_overrides(run_dir, overrides),
            *overrides,
            f"trainer.resume={checkpoint}",
            "trainer.eval_only=true",
            "trainer.checkpoint.save_last=false",
            "trainer.progress_bar=false",
            f"paths.output_dir={out}",
        ]
    )
    launch(cfg)
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    print(json.dumps({"checkpoint": str(checkpoint), **record}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
