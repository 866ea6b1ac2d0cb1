"""Every option of every config group, and every recipe, composes and trains for 2 steps.

Layout presets that tests/distributed/test_units.py already trains for 5 steps against a
one-process reference in make test, and options a README command trains as typed
(tests/recipes/test_cookbook.py), are not run twice (TRAINED_ELSEWHERE); every preset in
conf/parallel trains in make test.

Large models are shrunk by overrides (tests/conftest.py: tiny_overrides) that keep
their structure; multi-process recipes really start their processes.
"""

import math

import pytest

from disttrain_core.config import CONFIG_GROUPS, MODEL_MODULE_GROUPS, compose, group_options
from disttrain_core.launch.entry import launch

from ..conftest import REPO, SMALL_BATCH, base_overrides, read_metrics, tiny_overrides
from .test_gpu_recipes import GPU_RECIPES

PIPELINE = ["parallel=pp2", "trainer.devices=2"]
# The smallest companion overrides that make an option runnable here: a GPU preset on this CPU
# machine, a pipeline layout with a schedule (and the processes it needs), a schedule with stages.
COMPANION_OVERRIDES = {
    ("trainer", "gpu"): ["trainer.accelerator=cpu", "trainer.backend=gloo", "trainer.devices=1"],
    ("parallel", "pp2"): ["schedule=1f1b", "trainer.devices=2"],
    ("parallel", "pp4"): ["schedule=1f1b", "trainer.devices=4", "optim.micro_batch_size=4"],
    **{("schedule", name): PIPELINE for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")},
    # mllm_small under bf16 autocast on a CPU without native bf16 (tests/conftest.py SMALL_BATCH)
    ("recipe", "mllm_small_bf16"): SMALL_BATCH,
    # the same for mllm_small in fp32: 16 samples per step took 80 s of the suite
    ("model", "mllm_small"): SMALL_BATCH,
    # packed text documents: a text-only model
    ("data", "longtail_text"): ["model=llama_tiny"],
    # embedded data with audio clips: a model with an audio tower (else a one-line error)
    ("data", "synthetic_any2any"): ["model=any2any_tiny"],
}
TRAINED_ELSEWHERE = {
    ("parallel", name)
    for name in (
        "disagg4_enc2",
        "disagg4_tp2",
        "disagg4_pp2",
        "disagg4_llm2_gen1",
        "megatron_pp2",
        "hotspa",  # tests/distributed/test_hotspa.py: 5 steps against one process
    )
}
# Trained by a test of its own (the option -> the test file that trains it, with the option on its command line).
TRAINED_BY_TEST = {
    ("data", "tokens"): "tests/distributed/test_token_file_training.py",  # 4 steps, 1 and 2 processes
    # parquet / arrow / jsonl.gz files the test writes (data=hf reads no tar shards): resumed, 2 processes
    ("data", "hf"): "tests/distributed/test_hf_training.py",
    ("parallel", "disagg5_audio"): "tests/distributed/test_any2any.py",  # 5 steps against one process
    ("parallel", "disagg6_video"): "tests/distributed/test_any2any.py",  # 5 steps against one process
    ("model", "any2any_video_tiny"): "tests/distributed/test_any2any.py",  # the one process those match
    # 5 steps on 2 processes against one process, within 1e-5
    **{("schedule", name): "tests/distributed/test_pipeline_training.py" for name in ("zb_h2", "dualpipev")},
    ("schedule", "breadth_first"): "tests/distributed/test_pipeline_training.py",
}
TRAINED_ELSEWHERE |= set(TRAINED_BY_TEST)
# Run as typed (reduced alike) by tests/recipes/test_cookbook.py: the README's commands.
TRAINED_ELSEWHERE |= {
    ("parallel", "disagg2"),  # python train.py parallel=disagg2
    ("parallel", "auto"),  # python train.py parallel=auto trainer.devices=4
    ("parallel", "dp"),  # python train.py parallel=dp trainer.devices=2 parallel.shard=zero3
    ("parallel", "zero1"),  # python train.py parallel=zero1 trainer.devices=2 parallel.comm.bucket_mb=2
    ("parallel", "pp2"),  # python train.py model=llama_tiny parallel=pp2 schedule=1f1b trainer.devices=2
    ("parallel", "pp4"),  # python train.py parallel=pp4 schedule=zb_h1 trainer.devices=4 optim.micro_batch_size=2
    ("schedule", "1f1b"),
    ("schedule", "interleaved_1f1b"),  # python train.py parallel=pp2 schedule=interleaved_1f1b schedule.vpp=2 ...
    ("schedule", "zb_h1"),
    ("recipe", "mllm_tiny_ddp2"),  # python train.py recipe=mllm_tiny_ddp2
    ("parallel", "local_sgd"),  # python train.py parallel=local_sgd trainer.devices=4 ... shard_group=2 ...
}
CASES = [
    (group, option)
    for group in CONFIG_GROUPS
    if group not in ("recipe", "hparams_search", *MODEL_MODULE_GROUPS)  # modules: tests/unit/test_model_modules.py
    for option in group_options(group)
    if (group, option) not in TRAINED_ELSEWHERE
]
# GPU recipes cannot train here: tests/recipes/test_gpu_recipes.py plans and rehearses them (trainer.dry_run=true).
CASES += [
    ("recipe", name)
    for name in group_options("recipe")
    if ("recipe", name) not in TRAINED_ELSEWHERE and name not in GPU_RECIPES
]


@pytest.mark.parametrize("group, option", CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_option_trains_two_steps(group, option, shards, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [f"{group}={option}"] + base_overrides(shards, run_dir) + COMPANION_OVERRIDES.get((group, option), [])
    overrides += ["trainer.max_steps=2", "trainer.checkpoint.every_n_steps=0", "optim.warmup_steps=1"]
    cfg = compose(overrides)
    cfg = compose(overrides + tiny_overrides(cfg))
    launch(cfg)
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in metrics)
    assert (run_dir / "checkpoints" / "latest").is_file()
    assert (run_dir / "config.yaml").is_file()


def test_what_is_trained_elsewhere_is_trained_there():
    """Each skipped option is a README command's (run by test_cookbook.py) or a test_units.py layout."""
    from .test_cookbook import COMMANDS, kind

    units = (REPO / "tests/distributed/test_units.py").read_text()
    for group, option in TRAINED_ELSEWHERE:
        text = f"{group}={option}"
        if (group, option) in TRAINED_BY_TEST:
            assert f'"{text}"' in (REPO / TRAINED_BY_TEST[group, option]).read_text(), text
            continue
        run_by_cookbook = any(text in argv and kind(c) == "train" for c, argv in COMMANDS.items())
        assert run_by_cookbook or f'"{option}"' in units.split("def test_four_process_layouts")[0], text
