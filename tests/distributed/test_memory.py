"""The memory model against the runtime: model-state bytes per rank after an optimizer step, counted from
unique tensor storages (train/memory_report.py), within 1% of tools/memory.py -- DDP, lean ZeRO-1 and
FSDP2 zero3 on two processes -- and under the closed-form bounds: ZeRO-1 (8 + 12/dp) P, zero3 16/dp P
(plus padding)."""

import json

import pytest

from disttrain_core.config import compose
from disttrain_core.planner.workload import workload_of

from ..conftest import cli_overrides, run_train
from ..unit.test_memory_model import memory_tool

pytestmark = pytest.mark.distributed

RUN = ["trainer.max_steps=2", "trainer.precision=32", "trainer.checkpoint.every_n_steps=0"]
LAYOUT = [
    "model=llama_tiny",
    "parallel=dp",
    "trainer.devices=2",
    "optim.global_batch_size=8",
    "optim.micro_batch_size=2",
]


@pytest.mark.parametrize("shard", [pytest.param(s, marks=pytest.mark.slow) for s in ("none", "zero1")] + ["zero3"])
def test_counted_model_state_matches_the_memory_tool(shard, shards, tmp_path):
    layout = [*LAYOUT, f"parallel.shard={shard}"]
    run_dir = tmp_path / shard
    result = run_train(cli_overrides(shards, run_dir) + RUN + layout + ["trainer.memory_report_step=2"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    predicted = memory_tool(*layout, "trainer.precision=32")["roles"][0]["state"]
    P = workload_of(compose(["model=llama_tiny"]).model).units["llm"].params
    for rank in range(2):
        report = json.loads((run_dir / "memory" / f"rank{rank:05d}.json").read_text())
        counted = report["measured"]["state"]
        assert counted["total"] == pytest.approx(predicted["total"], rel=0.01), (counted, predicted)
        for key in ("params", "grads", "master", "moments"):
            assert counted[key] == pytest.approx(predicted[key], rel=0.01, abs=64), key
        bound = {"none": 16 * P, "zero1": (8 + 12 / 2) * P, "zero3": 16 / 2 * P}[shard]
        assert counted["total"] <= bound * 1.01
        assert report["measured"]["peak"] > counted["total"]  # activations came and went on top
