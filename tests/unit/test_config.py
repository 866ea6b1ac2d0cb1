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
