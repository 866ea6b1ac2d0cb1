"""The memory model (planner/memory.py, tools/memory.py): the textbook mixed-precision arithmetic on the
Llama-3 family against hand-computed values, and this runtime's per-mode model state."""

import json

import pytest

from disttrain_core.config import REPO_ROOT
from disttrain_core.planner.memory import model_state, standard_model_state, transient_bytes

from ..conftest import run_script

# Meta's published parameter counts, which the presets reproduce (tools/model_info.py).
LLAMA3_8B, LLAMA3_70B = 8_030_261_248, 70_553_706_496


def memory_tool(*args: str) -> dict:
    out = run_script(REPO_ROOT / "tools" / "memory.py", [*args, "format=json"], timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_llama3_standard_mixed_precision_state_by_hand():
    # bf16 params 2 + bf16 grads 2 + fp32 master 4 + Adam m 4 + Adam v 4 = 16 bytes per parameter
    eight = memory_tool("model=llama3_8b", "convention=standard")
    assert eight["parameters"] == LLAMA3_8B
    assert eight["bytes"]["total"] == 128_484_179_968  # 16 x 8,030,261,248
    # fp32 gradient accumulation adds a 4-byte buffer: 20 bytes per parameter
    accumulated = memory_tool("model=llama3_70b", "convention=standard", "fp32_grad_accumulation=true")
    assert accumulated["parameters"] == LLAMA3_70B
    assert accumulated["bytes"]["total"] == 1_411_074_129_920  # 20 x 70,553,706,496
    # ZeRO over 8 ranks (the Playbook's formulas): 4P + 12P/8, 2P + 14P/8, 16P/8
    P = LLAMA3_8B
    assert standard_model_state(P, 8, 1)["total"] == pytest.approx(4 * P + 12 * P / 8)
    assert standard_model_state(P, 8, 2)["total"] == pytest.approx(2 * P + 14 * P / 8)
    assert standard_model_state(P, 8, 3)["total"] == pytest.approx(16 * P / 8)
    assert standard_model_state(P, 8, 1, fp32_grad_accumulation=True)["total"] == pytest.approx(8 * P + 12 * P / 8)


def test_runtime_model_state_per_shard_mode():
    P, T = 1000.0, 800.0  # 200 frozen parameters
    assert model_state(P, T, 4, "none").total == 4 * P + 12 * T
    lean = model_state(P, T, 4, "zero1")
    assert lean.total == 4 * P + 4 * T + 12 * T / 4 and lean.buffers == 0
    assert model_state(P, T, 4, "zero1", wire_bytes=2).buffers == 2 * T  # the bf16 gather buffer
    assert model_state(P, T, 4, "zero3").total == (4 * P + 12 * T) / 4
    assert model_state(P, T, 4, "zero2").total == model_state(P, T, 4, "zero3").total  # same state between steps
    assert model_state(P, T, 4, "zero3", hsdp_replicas=2).total == (4 * P + 12 * T) / 2  # sharded over 2 only
    with pytest.raises(ValueError, match="allowed values are none, zero1, zero2, zero3"):
        model_state(P, T, 4, "zero4")


def test_what_a_step_holds_beyond_the_state():
    # zero2 keeps every group gathered from forward to backward; zero3 two groups (compute + prefetch)
    assert transient_bytes(1000, 100, "zero2", 1, mixed=False) > transient_bytes(1000, 100, "zero3", 1, mixed=False)
    # autocast keeps one bf16 copy of the weights per step (one region) when the compute sees fp32 weights
    assert transient_bytes(1000, 100, "zero1", 3, mixed=True, wire_bytes=2) == 2 * 1000
    assert transient_bytes(1000, 100, "zero3", 3, mixed=True, wire_bytes=2) == 2 * 100 * 2 + 4 * 100  # bf16 gather


def test_memory_tool_breaks_down_a_disaggregated_layout():
    result = memory_tool(
        "model=mllm_tiny", "parallel=disagg4_llm2_gen1", "parallel.units.llm.shard=zero3", "trainer.precision=32"
    )
    roles = {(r["unit"], r["pp"]): r for r in result["roles"]}
    assert set(roles) == {("encoder", 0), ("llm", 0), ("generator", 0)}
    assert roles[("llm", 0)]["shard"] == "zero3" and roles[("encoder", 0)]["shard"] == "zero1"
    llm = result["params"]["llm"]
    assert roles[("llm", 0)]["state"]["total"] == pytest.approx(16 * llm / 2)
    assert roles[("llm", 0)]["logits"] > 0 and roles[("encoder", 0)]["logits"] == 0


def test_sgd_and_local_sgd_state_is_what_their_optimizers_allocate():
    """optim=sgd keeps a momentum buffer (4 bytes) or nothing; local SGD adds its share of the fp32 anchors and
    of the outer momentum (train/local_sgd/sync.py keeps them for owned parameters only)."""
    from disttrain_core.config import compose, typed_config
    from disttrain_core.planner.memory import model_state, optimizer_state_bytes

    def cfg(*overrides):
        return typed_config(compose(["trainer.devices=4", *overrides]))

    assert optimizer_state_bytes(cfg()) == (8.0, (0.0, 0.0))
    assert optimizer_state_bytes(cfg("optim=sgd")) == (0.0, (0.0, 0.0))
    assert optimizer_state_bytes(cfg("optim=sgd", "optim.momentum=0.9")) == (4.0, (0.0, 0.0))
    local = ["parallel=local_sgd", "parallel.local_sgd.shard_group=2"]
    assert optimizer_state_bytes(cfg(*local)) == (8.0, (2.0, 2.0))
    assert optimizer_state_bytes(cfg(*local, "parallel.local_sgd.method=post_local_sgd")) == (8.0, (2.0, 0.0))
    assert optimizer_state_bytes(cfg(*local, "parallel.local_sgd.offload=true")) == (8.0, (0.0, 0.0))  # host memory
    state = model_state(1000, 1000, 4, "none", moment_bytes=4.0, outer=(2.0, 2.0))
    assert (state.params, state.grads, state.master, state.moments) == (4000, 4000, 2000, 6000)
    # FSDP2 workers of 2 processes (HSDP with a replica per worker): everything is a half
    state = model_state(1000, 1000, 4, "zero3", hsdp_replicas=2, outer=(2.0, 2.0))
    assert (state.params, state.grads, state.master, state.moments) == (2000, 2000, 2000, 6000)


def test_the_memory_tool_reads_a_hotspa_run_as_its_home_strategy():
    """parallel=hotspa has one layout per bucket; the tool shows the home strategy's (parallel/resolved.py)."""
    out = memory_tool("model=llama_tiny", "data=longtail_text", "parallel=hotspa")
    assert out["roles"], out
