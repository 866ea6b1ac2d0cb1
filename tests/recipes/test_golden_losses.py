"""Golden losses, as TorchTitan's and torchtune's CI keep them: the first losses of every CPU recipe, pinned.

The parity tests compare layouts with one process, so a change that moves the numerics of one process and of
every layout alike (an initialization, a loss's reduction, a data order) passes all of them; it fails here.
Each recipe trains STEPS steps on the test shards (tests/conftest.py ``shards``: the embedded generator's
seed-0 shards, 4 of 8 samples) with its own model, layout and precision, and its logged losses must equal the
pinned ones within the tolerance stated in the file (relative, per step; bf16 recipes get a looser one). A recipe
in REDUCED runs with the overrides it names, and the file records them beside its losses.

The file names the torch version it was written with; a run on another torch says so in the failure message.
After a deliberate numerical change, rewrite the file and say why in the commit:

    DISTTRAIN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/recipes/test_golden_losses.py
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from disttrain_core.config import CONF_DIR, compose, training_precision
from disttrain_core.launch.entry import launch

from ..conftest import REPO, SMALL_BATCH, base_overrides, read_metrics

pytestmark = pytest.mark.distributed

GOLDEN = REPO / "tests" / "recipes" / "golden_losses.json"
STEPS = 3
TOLERANCE = {"32": 1e-4, "bf16-mixed": 2e-3}  # relative, per step: fp32 / bf16 autocast on CPU
# mllm_small's 16-sample steps under bf16 autocast: 646 s of the suite on a CPU without native bf16 (conftest)
REDUCED = {"mllm_small_bf16": SMALL_BATCH}


def cpu_recipes() -> list[str]:
    names = sorted(p.stem for p in (CONF_DIR.parent / "recipes").glob("*.yaml"))
    return [name for name in names if compose([f"recipe={name}"]).cluster.device == "cpu"]


RECIPES = cpu_recipes()


def first_losses(recipe: str, shards, run_dir) -> tuple[list[float], str]:
    overrides = [f"recipe={recipe}", *base_overrides(shards, run_dir), f"trainer.max_steps={STEPS}"]
    overrides += REDUCED.get(recipe, [])
    cfg = compose(overrides)
    launch(cfg)
    return [m["loss"] for m in read_metrics(run_dir)], training_precision(cfg.trainer.precision, "cpu")


def test_every_cpu_recipe_is_pinned():
    assert RECIPES, "no CPU recipe found"
    pinned = json.loads(GOLDEN.read_text())["recipes"] if GOLDEN.is_file() else {}
    missing = [name for name in RECIPES if name not in pinned]
    stale = [name for name in pinned if name not in RECIPES]
    assert not missing and not stale, f"golden losses missing for {missing}, stale for {stale}: rewrite the file"


@pytest.mark.parametrize("recipe", RECIPES)
def test_first_losses_equal_the_golden_ones(recipe, shards, tmp_path):
    losses, precision = first_losses(recipe, shards, tmp_path / "run")
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    if os.environ.get("DISTTRAIN_UPDATE_GOLDEN"):
        data = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {"recipes": {}}
        data["torch"] = torch.__version__.split("+")[0]
        data["steps"] = STEPS
        data["tolerance"] = {k: v for k, v in TOLERANCE.items()}
        data["recipes"][recipe] = {"precision": precision, "losses": losses}
        if recipe in REDUCED:
            data["recipes"][recipe]["overrides"] = REDUCED[recipe]
        data["recipes"] = dict(sorted(data["recipes"].items()))
        GOLDEN.write_text(json.dumps(data, indent=1) + "\n")
        return
    data = json.loads(GOLDEN.read_text())
    pinned = data["recipes"][recipe]
    assert pinned.get("overrides", []) == REDUCED.get(recipe, []), (
        f"{recipe}: pinned with overrides {pinned.get('overrides', [])}, run with {REDUCED.get(recipe, [])}: "
        "rewrite the file (DISTTRAIN_UPDATE_GOLDEN=1)"
    )
    golden = pinned["losses"]
    tolerance = data["tolerance"][precision]
    where = f"{recipe} (pinned with torch {data['torch']}, running torch {torch.__version__})"
    assert losses == pytest.approx(golden, rel=tolerance), f"{where}: losses {losses} vs golden {golden}"
