"""trainer.compile (parallel/compile.py: torch.compile per block) trains like one eager process in every
engine: DDP on 2 processes, a 1F1B pipeline, a disaggregated layout, FSDP2 zero3, and ZeRO-1 with its
gradient reduce-scatters and parameter gathers overlapped -- per-step losses and final parameters within
1e-4 of eager (fp32, 5 optimizer steps), with no graph break and no eager fallback. HotSPa's compiled
strategies: tests/distributed/test_hotspa.py.

Compiling a block's forward leaves the hooks around it eager, so the ZeRO-1 run's trace still shows
reduce-scatters issued while the backward runs (docs/COMM.md). Context and expert parallelism compiled:
make test-slow, below."""

import json

import pytest

from ..conftest import read_metrics
from .test_units import SMALL, assert_same_run, train

pytestmark = pytest.mark.distributed

COMPILE = ["trainer.compile=true", "trainer.log_every_n_steps=1"]
OVERLAP = [
    "parallel.comm.overlap_grad_reduce=true",
    "parallel.comm.overlap_param_gather=true",
    "parallel.comm.bucket_mb=0.05",
    "parallel.comm.trace=true",
]


TEXT = ["model=llama_tiny"]  # one decoder graph to compile (cold, tens of seconds on 2 cores) instead of 15
# The multimodal case with a one-level U-Net (a down, a middle and an up block, cross-attention kept): 5 graphs
# to compile instead of 11 with unet_tiny's two levels (one process, cold: 91 s instead of 234 s here).
ONE_LEVEL_UNET = ["model.generator.block_out_channels=[32]", "model.generator.cross_attention_blocks=[true]"]


@pytest.fixture(scope="module")
def reference(one_process):
    return one_process(*ONE_LEVEL_UNET, *SMALL)


@pytest.fixture(scope="module")
def text_reference(one_process):
    return one_process(*TEXT, *SMALL)


def issued_during_backward(trace: list[dict]) -> int:
    """Reduce-scatters issued before the last backward span of their step ended."""
    steps = [e for e in trace if e["lane"] == "step"]
    count = 0
    for step in steps:
        inside = [e for e in trace if step["start"] <= e["start"] <= step["end"]]
        backward = [e["end"] for e in inside if e["lane"] == "compute" and e["name"].startswith("backward")]
        if backward:
            count += sum(1 for e in inside if e["name"].startswith("reduce-scatter") and e["start"] < max(backward))
    return count


@pytest.mark.parametrize(
    "layout",
    [
        [*TEXT, "parallel=dp", "trainer.devices=2"],
        # make test-slow: disagg2 runs the same pipeline executor across two units
        pytest.param([*TEXT, "parallel=pp2", "schedule=1f1b", "trainer.devices=2"], marks=pytest.mark.slow),
        ["parallel=disagg2", *ONE_LEVEL_UNET],  # the multimodal model: ViT and U-Net blocks compiled too
        [*TEXT, "parallel=dp", "parallel.shard=zero3", "trainer.devices=2"],
        [*TEXT, "parallel=zero1", "trainer.devices=2", *OVERLAP],
    ],
    ids=["ddp", "pp2", "disagg2", "zero3", "zero1_overlap"],
)
def test_compiled_blocks_train_like_eager(layout, reference, text_reference, shards, tmp_path):
    run = train(shards, tmp_path / "compiled", *layout, *SMALL, *COMPILE)
    assert_same_run(run, text_reference if layout[0] == TEXT[0] else reference)
    last = read_metrics(run)[-1]
    assert last["compile/graphs"] >= 1, last  # it did compile
    assert last["compile/graph_breaks"] == 0 and last["compile/eager_fallbacks"] == 0, last
    if "parallel.comm.trace=true" in layout:
        for rank in range(2):
            trace = json.loads((run / "comm_trace" / f"rank{rank:05d}.json").read_text())
            assert issued_during_backward(trace) > 0, rank


@pytest.mark.slow  # 2 runs on 4 processes and a reference, about 70 s; make test-slow
def test_compiled_context_and_expert_parallelism_train_like_eager(shards, tmp_path):
    """Ring attention (cp=2) and routed experts (ep=2, all-to-all) run eagerly between a block's compiled
    pieces (parallel/compile.py): one graph break each, and the losses and parameters of one eager process."""
    text = ["model=llama_tiny", *SMALL]
    reference = train(shards, tmp_path / "text", *text)
    cp = train(shards, tmp_path / "cp2", *text, "parallel=dp", "parallel.cp=2", "trainer.devices=4", *COMPILE)
    assert_same_run(cp, reference)
    moe = ["model=llama_moe_tiny", "optim.global_batch_size=16", "model.llm.moe.experts_kernel=grouped"]
    one = train(shards, tmp_path / "moe", *moe, "optim.micro_batch_size=8")
    ep = ["parallel=zero1", "parallel.ep=2", "trainer.devices=4", "optim.micro_batch_size=2"]
    assert_same_run(train(shards, tmp_path / "ep2", *moe, *ep, *COMPILE), one)
    for run in (cp, tmp_path / "ep2"):
        assert read_metrics(run)[-1]["compile/eager_fallbacks"] == 0
