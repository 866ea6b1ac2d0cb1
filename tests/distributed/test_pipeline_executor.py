"""Every schedule, run for real across 2 and 4 processes, reproduces the single-process
losses and gradients (fp32, within 1e-5)."""

import pytest
import torch

from disttrain_core.config import compose

from .pipeline_reference import reference
from .pipeline_worker import main as worker
from .spawn import start_processes

pytestmark = pytest.mark.distributed

CASES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("breadth_first", 2),
    ("zb_h1", 1),
    ("zb_h2", 1),
    ("zbv", 2),
    ("dualpipev", 2),
]
# 8 layers split over up to 4 ranks x 2 stages; an MLLM so the encoder and generator ride along.
MODEL = [
    "model.llm.n_layers=8",
    "model.llm.dim=64",
    "model.llm.ffn_dim=128",
    "model.seq_len=96",
    "model.encoder.n_layers=1",
    "trainer.seed=7",
]


@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_matches_one_process(world, shards, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    start_processes(
        worker,
        args=(world, str(tmp_path / "store"), str(out), str(shards), MODEL, CASES),
        nprocs=world,
        join=True,
    )
    cfg = compose([f"data.path={shards}"] + MODEL)
    ref_sums, ref_grads = reference(cfg)
    for name, vpp in CASES:
        parts = [torch.load(out / f"{name}_v{vpp}_rank{r}.pt", weights_only=True) for r in range(world)]
        grads = {n: g for part in parts for n, g in part["grads"].items()}
        assert set(grads) == set(ref_grads), (name, set(ref_grads) ^ set(grads))
        worst = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
        assert worst < 1e-5, (name, world, worst)
        sums = {k: sum(p["sums"].get(k, 0.0) for p in parts) for k in ref_sums}
        for key, value in ref_sums.items():
            assert sums[key] == pytest.approx(value, rel=1e-6, abs=1e-6), (name, key)
