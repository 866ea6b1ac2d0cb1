"""Model modules as config groups (conf/model/encoder, conf/model/llm, conf/model/generator): the presets are
their choices plus deltas, a module swaps on the command line, and a model composed from modules trains as the
preset it spells out."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from disttrain_core.config import CONF_DIR, MODEL_MODULE_GROUPS, compose, group_options

from ..conftest import base_overrides, read_metrics

MODULE_GROUPS = MODEL_MODULE_GROUPS


def _model(overrides: list[str]) -> dict:
    return OmegaConf.to_container(compose(overrides).model, resolve=True)


def _chosen(preset: str) -> dict[str, str | None]:
    """The module options a preset's defaults list names (None: that part is absent)."""
    defaults = OmegaConf.load(CONF_DIR / "model" / f"{preset}.yaml")["defaults"]
    chosen = {}
    for entry in defaults:
        if isinstance(entry, str):
            continue
        ((part, option),) = entry.items()
        chosen[f"model/{part}"] = option
    return chosen


def test_every_module_group_has_options_and_every_option_is_used_by_a_preset():
    used = {group: set() for group in MODULE_GROUPS}
    for preset in group_options("model"):
        for group, option in _chosen(preset).items():
            if option is not None:
                used[group].add(option)
    for group in MODULE_GROUPS:
        options = set(group_options(group))
        assert options, group
        if group not in (
            "model/audio_encoder",
            "model/audio_generator",
            "model/video_encoder",
        ):  # published sizes no preset uses yet
            assert options == used[group], f"{group}: options no preset uses: {options - used[group]}"
        assert group in {g for preset in group_options("model") for g in _chosen(preset)}, group


@pytest.mark.parametrize("preset", group_options("model"))
def test_a_preset_is_its_modules_on_any_other_preset(preset):
    """Choosing a preset's modules on top of another preset (and the preset's own deltas) composes the same model:
    what a preset adds beyond its modules is in its own file, not hidden in a module. (The other preset's own deltas
    carry over where the preset leaves them unset, as any Hydra group's values do.)"""
    other = "llama_tiny" if preset != "llama_tiny" else "mllm_small"
    own = OmegaConf.load(CONF_DIR / "model" / f"{preset}.yaml")
    deltas = [
        f"model.{key}={OmegaConf.to_yaml(value).strip() if OmegaConf.is_config(value) else value}"
        for key, value in own.items()
        if key != "defaults"
    ]
    modules = []
    for group, option in _chosen(preset).items():
        modules.append(f"model/{group.split('/')[1]}={option}" if option else f"~{group}")
    expected = _model([f"model={preset}"])
    composed = _model([f"model={other}", *modules, *deltas])
    for part in ("llm", "encoder", "generator", "audio_encoder", "video_encoder"):
        assert composed[part] == expected[part], (preset, part)
    if other == "llama_tiny":  # sets only name, family and seq_len, which every preset sets: nothing carries over
        assert composed == expected


def test_one_module_swaps_and_nothing_else_moves():
    base = _model(["model=mllm72b"])
    swapped = _model(["model=mllm72b", "model/encoder=vit_tiny"])
    assert swapped["encoder"] == _model(["model=mllm_tiny"])["encoder"]
    assert {k: v for k, v in swapped.items() if k != "encoder"} == {k: v for k, v in base.items() if k != "encoder"}
    text_only = _model(["model=mllm72b", "~model/encoder", "~model/generator", "model.family=llama"])
    assert text_only["encoder"] is None and text_only["generator"] is None
    assert text_only["llm"] == base["llm"]


def test_a_text_preset_takes_a_module_without_a_plus():
    """The text-only presets list ``encoder: null`` in their defaults, so ``model/encoder=...`` needs no ``+``."""
    cfg = _model(["model=llama3_8b", "model/encoder=vit_h14", "model/generator=sd21_unet", "model.family=mllm"])
    assert cfg["encoder"] == _model(["model=mllm9b"])["encoder"]
    assert cfg["generator"] == _model(["model=mllm9b"])["generator"]


@pytest.mark.distributed
def test_the_modules_of_mllm_tiny_train_as_the_preset(shards, tmp_path):
    """``python train.py model/encoder=vit_tiny model/llm=llama_tiny model/generator=unet_tiny`` (here on the
    text-only preset, with mllm_tiny's own deltas) logs the losses of ``model=mllm_tiny`` within 1e-6: same seed,
    same data, 2 steps."""
    from disttrain_core.launch.entry import launch

    modules = ["model=llama_tiny", "model/encoder=vit_tiny", "model/llm=llama_tiny", "model/generator=unet_tiny"]
    deltas = ["model.name=mllm_tiny", "model.family=mllm", "model.gen_tokens=4", "model.gen_image_size=32"]
    deltas += ["model.latent_downsample=4", "model.nominal_images_per_sample=2.0"]
    losses = {}
    for name, choice in (("preset", ["model=mllm_tiny"]), ("modules", modules + deltas)):
        run_dir = tmp_path / name
        launch(compose([*choice, *base_overrides(shards, run_dir), "trainer.max_steps=2", "optim.warmup_steps=1"]))
        losses[name] = [m["loss"] for m in read_metrics(run_dir)]
    assert len(losses["preset"]) == 2
    assert losses["modules"] == pytest.approx(losses["preset"], rel=1e-6)
