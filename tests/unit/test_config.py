"""The typed schema: every option composes; unknown keys and bad types fail at compose time."""

import pytest
from hydra.errors import ConfigCompositionException

from disttrain_core.config import CONFIG_GROUPS, compose, group_options


def test_every_group_has_options_and_each_composes():
    for group in CONFIG_GROUPS:
        options = group_options(group)
        assert options, f"config group {group} has no options"
        for option in options:
            cfg = compose([f"{group}={option}"])
            assert cfg.model.name  # composed against the schema


def test_unknown_key_fails_naming_the_key():
    with pytest.raises(ConfigCompositionException) as info:
        compose(["trainer.max_stepz=5"])
    assert "max_stepz" in str(info.value.__cause__ or info.value)


def test_wrong_type_fails_naming_the_key():
    with pytest.raises(ConfigCompositionException) as info:
        compose(["optim.lr=abc"])
    text = str(info.value) + str(info.value.__cause__)
    assert "optim.lr" in text and "abc" in text


def test_recipe_overrides_defaults_and_keeps_schema_types():
    cfg = compose(["recipe=mllm_tiny_ddp2"])
    assert cfg.trainer.devices == 2
    assert cfg.trainer.accelerator == "cpu"
    assert isinstance(cfg.optim.lr, float)


def test_recipe_headers_show_their_launch_command():
    from disttrain_core.config import RECIPES_DIR

    for recipe in group_options("recipe"):
        text = (RECIPES_DIR / f"{recipe}.yaml").read_text()
        assert text.startswith("# @package _global_"), recipe
        assert f"# Launch: python train.py recipe={recipe}" in text, recipe


def test_composing_from_the_kept_defaults_equals_hydras_own_composition():
    """config.compose keeps the composed defaults per set of group choices and applies field overrides to a copy
    (Hydra's own function): the same config, flags and errors as a fresh Hydra composition, and a copy the
    caller may change without changing the next one."""
    from omegaconf import OmegaConf

    from disttrain_core.config import _hydra_compose

    cases = [
        [],
        ["parallel=disagg2", "optim.lr=1e-3"],
        ["model=llama_tiny", "model.llm.n_layers=2", "hydra.run.dir=/tmp/run"],
        ["trainer.devices=2", "parallel=dp", "hydra.run.dir=/tmp/other"],
        ["optim.lr=${optim.min_lr_ratio}"],
        ["model/encoder=vit_small", "model.encoder.dim=64"],
        ["recipe=mllm_tiny_ddp2", "trainer.max_steps=3"],
    ]
    for overrides in cases:
        fresh, kept = _hydra_compose(overrides, False), compose(overrides)
        assert OmegaConf.to_yaml(kept) == OmegaConf.to_yaml(fresh), overrides
        assert OmegaConf.is_struct(kept) == OmegaConf.is_struct(fresh) and type(kept) is type(fresh), overrides
    changed = compose(["parallel=disagg2"])
    changed.optim.lr = 123.0
    assert compose(["parallel=disagg2"]).optim.lr != 123.0
    for bad in (["optim.lrr=1"], ["hydra.run.dirr=/x"], ["optim.lr=abc"], ["model=llama_tiny", "model.encoder.dim=8"]):
        errors = []
        for composition in (lambda bad=bad: _hydra_compose(bad, False), lambda bad=bad: compose(bad)):
            with pytest.raises(Exception) as raised:
                composition()
            errors.append((type(raised.value), str(raised.value)))
        assert errors[0] == errors[1], bad
