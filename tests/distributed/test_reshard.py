"""Resharding resume: a checkpoint saved at step 3 by layout A resumes in layout B, and steps 4-6 equal an
uninterrupted run in layout B from the same initial weights within 1e-5 (fp32).

Each layout trains once for 6 steps, checkpointing every 3: that run is both layout B's uninterrupted
reference and layout A's step-3 checkpoint. Each pair (A, B) then resumes B from A's step 3, so k layouts
in a cycle give k pairs for 2k runs. The default suite runs a two-layout cycle (ZeRO-1's flattened chunks
on 2 replicas <-> tensor-parallel DTensor shards, a data-parallel size change 2 <-> 1); ``make test-slow``
runs six text-model layouts and the multimodal units <-> megatron pair.
"""

import shutil

import pytest

from ..conftest import cli_overrides, read_metrics, run_train

pytestmark = pytest.mark.distributed

COMMON = [
    "trainer.max_steps=6",
    "trainer.precision=32",
    "trainer.checkpoint.every_n_steps=3",
    "trainer.checkpoint.keep_last=2",
    "optim.global_batch_size=8",
    "optim.micro_batch_size=2",
    "optim.warmup_steps=2",
]
TEXT = ["model=llama_tiny"]
LAYOUTS = {
    # plain data parallelism: DDP on 2 replicas, and one process (a data-parallel size change)
    "ddp2": ["parallel=dp", "trainer.devices=2"],
    "one": ["parallel=single", "trainer.devices=1"],
    # ZeRO-1's bucket slices cut parameters mid-row: saved as flattened chunks
    "zero1_dp2": ["parallel=zero1", "trainer.devices=2"],
    # FSDP2 DTensor shards on 2 replicas
    "fsdp_dp2": ["parallel=dp", "parallel.shard=zero3", "trainer.devices=2"],
    # tensor parallelism (DTensor, ZeRO-1 over 1 replica)
    "tp2": ["parallel=megatron_tp2", "trainer.devices=2", "schedule=none"],
    # two pipeline stages under 1F1B
    "pp2": ["parallel=megatron_pp2", "trainer.devices=2", "parallel.dp=1", "schedule=1f1b"],
    # disaggregated units (encoder | LLM + generator) and the same model in the rigid megatron layout
    "units": ["parallel=disagg2"],
    "mm_zero1_dp2": ["parallel=zero1", "trainer.devices=2"],
}


def _train(shards, run_dir, *overrides):
    result = run_train(cli_overrides(shards, run_dir) + COMMON + list(overrides), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _losses(run_dir, steps):
    by_step = {m["step"]: m["loss"] for m in read_metrics(run_dir)}
    return [by_step[s] for s in steps]


def _check_cycle(shards, tmp_path, model, names):
    straight = {}
    for name in names:
        straight[name] = tmp_path / f"straight_{name}"
        _train(shards, straight[name], *model, *LAYOUTS[name])
    for source, target in zip(names, names[1:] + names[:1], strict=True):
        run_dir = tmp_path / f"{source}_to_{target}"
        checkpoint = run_dir / "from" / "step_00000003"
        shutil.copytree(straight[source] / "checkpoints" / "step_00000003", checkpoint)
        result = _train(shards, run_dir, *model, *LAYOUTS[target], f"trainer.resume={checkpoint}")
        assert "resumed from" in result.stdout + result.stderr
        resumed, reference = _losses(run_dir, [4, 5, 6]), _losses(straight[target], [4, 5, 6])
        assert resumed == pytest.approx(reference, abs=1e-5), (source, target, resumed, reference)


def test_zero1_chunks_and_tensor_parallel_shards_reshard_both_ways(shards, tmp_path):
    """ZeRO-1 on 2 replicas (flattened chunks, 2 data streams) <-> TP 2 (DTensor rows/columns, 1 stream)."""
    _check_cycle(shards, tmp_path, TEXT, ["zero1_dp2", "tp2"])


@pytest.mark.slow  # 12 runs of 2 processes (about 4 minutes here)
def test_text_model_reshards_across_six_layouts(shards, tmp_path):
    _check_cycle(shards, tmp_path, TEXT, ["ddp2", "fsdp_dp2", "pp2", "one", "zero1_dp2", "tp2"])


@pytest.mark.slow  # 4 runs of 2 processes
def test_multimodal_units_reshard_to_the_rigid_layout(shards, tmp_path):
    _check_cycle(shards, tmp_path, [], ["units", "mm_zero1_dp2"])
