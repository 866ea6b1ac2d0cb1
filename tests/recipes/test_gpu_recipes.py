"""The GPU recipes (recipes/*.yaml tagged ``gpu``): each composes, validates and -- with ``trainer.dry_run=true``,
since this machine has no GPU -- plans (``parallel=auto``) and rehearses every rank role on the meta device here;
its header states the GPUs, memory and cluster preset the config really uses; its layout fits that preset's
memory by the planner's model and keeps tensor parallelism inside a node; an auto recipe's plan uses exactly the
GPUs its job allocates. The CPU recipes train 2 steps in tests/recipes/test_every_option_trains.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from disttrain_core.config import RECIPES_DIR, compose, group_options, typed_config
from disttrain_core.launch.cluster import read_header
from disttrain_core.launch.entry import launch
from disttrain_core.planner.fit import fullest_role, validate_run

from ..conftest import base_overrides


def _tags(recipe: str) -> list[str]:
    return list(OmegaConf.load(RECIPES_DIR / f"{recipe}.yaml").get("tags") or [])


GPU_RECIPES = [name for name in group_options("recipe") if "gpu" in _tags(name)]
CPU_RECIPES = [name for name in group_options("recipe") if name not in GPU_RECIPES]
LAUNCHER_PRESETS = ["slurm", "slurm_short"]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """Pre-tokenized text for the data=tokens recipes: more than one 131,072-token window of Llama-3 ids."""
    path = tmp_path_factory.mktemp("tokens") / "tokens.npy"
    np.save(path, (np.arange(140_000, dtype=np.uint32) * 7919) % 128_000)
    return path


def data_overrides(recipe: str, shards, tokens) -> list[str]:
    """What stands for the data a recipe's header asks for (its placeholders) on this machine."""
    cfg = compose([f"recipe={recipe}"])
    if cfg.data.format == "tokens":
        return [f"data.path={tokens}"]
    if cfg.data.packing.enabled:
        return [f"data.packing.corpus={shards}"]  # the test shards' captions as a text corpus
    return [f"data.path={shards}", "data.generate_if_missing=false"]


def test_there_are_gpu_recipes_of_every_kind_the_issue_names():
    assert len(GPU_RECIPES) >= 9, GPU_RECIPES
    modes = {compose([f"recipe={name}"]).parallel.mode for name in GPU_RECIPES}
    assert modes >= {"auto", "manual", "megatron", "ddp", "hotspa", "local_sgd"}, modes


@pytest.mark.parametrize("recipe", group_options("recipe"))
def test_gpu_tag_header_and_cluster_agree(recipe):
    cfg = compose([f"recipe={recipe}"])
    header = read_header(recipe)
    is_gpu = recipe in GPU_RECIPES
    assert (cfg.cluster.device == "cuda") == is_gpu, recipe
    assert (header.assumptions is not None) == is_gpu, f"{recipe}: a GPU recipe's header says what it assumes"


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_header_states_the_gpus_memory_and_cluster_the_config_uses(recipe):
    cfg = compose([f"recipe={recipe}"])
    said = read_header(recipe).assumptions
    t, c = cfg.trainer, cfg.cluster
    assert (said.nodes, said.gpus_per_node, said.gpus) == (t.num_nodes, t.devices, t.devices * t.num_nodes)
    assert said.cluster == c.name and said.memory_gb == c.memory_per_device_gb
    assert t.accelerator == "cuda" and t.precision == "bf16-mixed" and t.resume == "auto"
    assert t.checkpoint.every_n_steps > 0
    if cfg.parallel.mode == "auto":  # every rank plans alike only from the same (analytic) costs
        assert cfg.planner.cost == "analytic"


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_layout_fits_the_cluster_memory_and_keeps_tensor_parallelism_in_a_node(recipe, shards, tokens):
    cfg = typed_config(compose([f"recipe={recipe}", "trainer.dry_run=true", *data_overrides(recipe, shards, tokens)]))
    run = validate_run(cfg)  # the cluster preset's GPUs and memory against the layout, among every other check
    if cfg.parallel.mode in ("auto", "hotspa"):
        return  # planned within the preset / each strategy checked per bucket (planner/fit.py)
    role, usable = fullest_role(cfg, run.layout)
    assert role.total <= usable, (role.unit, role.pp, role.total / 1e9)
    per_node = cfg.trainer.devices
    for unit in run.layout.units:
        for pp in range(unit.pp):
            for dp in range(unit.dp):
                for group in range(unit.inner // unit.tp):  # one TP group per context-parallel rank
                    ranks = [unit.rank_at(dp, group * unit.tp + tp, pp) for tp in range(unit.tp)]
                    assert len({rank // per_node for rank in ranks}) == 1, (unit.name, ranks)


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_recipe_plans_and_rehearses_here(recipe, shards, tokens, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [f"recipe={recipe}", "trainer.dry_run=true", *data_overrides(recipe, shards, tokens)]
    overrides += [o for o in base_overrides(shards, run_dir) if o.startswith(("paths.output_dir", "trainer.progress"))]
    cfg = compose(overrides)
    assert launch(cfg) is None  # a dry run trains nothing
    rehearsal = json.loads((run_dir / "rehearsal.json").read_text())
    assert rehearsal["roles"]
    for role in rehearsal["roles"]:  # the runtime's modules, built on meta, hold what the planner counts
        assert role["ratio"] == pytest.approx(1.0, abs=0.02), role
    if cfg.parallel.mode != "auto":
        assert rehearsal["world_size"] == cfg.trainer.devices * cfg.trainer.num_nodes
        return
    plan = json.loads((run_dir / "plan.json").read_text())
    # every rank of the job is in the plan, so srun's tasks are exactly the plan's GPUs
    assert plan["gpus_used"] == cfg.trainer.devices * cfg.trainer.num_nodes == cfg.cluster.num_gpus
    minutes = plan["predicted_iteration_s"] * cfg.trainer.checkpoint.every_n_steps / 60
    assert 10 <= minutes <= 60, f"a checkpoint every {minutes:.0f} minutes of predicted steps"


@pytest.mark.parametrize("launcher", LAUNCHER_PRESETS)
def test_slurm_signals_before_any_recipe_may_take_to_stop(launcher):
    for recipe in GPU_RECIPES:
        cfg = compose([f"recipe={recipe}", f"hydra/launcher={launcher}"], return_hydra_config=True)
        lead = cfg.hydra.launcher.signal_delay_s
        assert cfg.hydra.launcher.additional_parameters.signal == f"TERM@{lead}"
        assert lead > cfg.trainer.stop_grace_s, (recipe, launcher)
        assert cfg.hydra.launcher.nodes == cfg.trainer.num_nodes
        assert cfg.hydra.launcher.tasks_per_node == cfg.hydra.launcher.gpus_per_node == cfg.trainer.devices
