"""parallel/compile.py: every block is compiled in place (names, parameters and results unchanged), and
CompileWatch reports what would make a compiled run slower -- a graph break with its reason, a frame left
eager at the recompile limit, a compilation after the first steps -- instead of staying silent."""

import logging

import pytest
import torch

from disttrain_core.models.llama import DecoderBlock, Llama, LlamaConfig
from disttrain_core.parallel.compile import CompileWatch, apply_compile


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def test_every_block_compiles_in_place_with_names_and_results_unchanged():
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=64)
    torch.manual_seed(0)
    eager = Llama(cfg, max_seq_len=16)
    compiled = Llama(cfg, max_seq_len=16)
    compiled.load_state_dict(eager.state_dict())
    assert apply_compile(compiled, backend="aot_eager") == 2
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no _orig_mod. prefixes
    assert all(isinstance(b, DecoderBlock) for b in compiled.layers.values())
    tokens = torch.randint(0, 64, (2, 16))
    want, got = eager(tokens), compiled(tokens)
    assert torch.allclose(got, want, atol=1e-6)
    want.sum().backward()
    got.sum().backward()
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the second block reuses the graph


def test_watch_logs_graph_breaks_eager_fallbacks_and_late_recompiles(caplog):
    watch = CompileWatch(rank=0, warmup_steps=1)

    def breaks(x):
        y = x.sin()
        torch._dynamo.graph_break()
        return y * 2

    compiled = torch.compile(breaks, backend="eager")
    compiled(torch.ones(3))
    with caplog.at_level(logging.WARNING, logger="disttrain_core.parallel.compile"):
        watch.after_step(1)
    assert "graph break" in caplog.text and watch.metrics()["compile/graph_breaks"] == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="disttrain_core.parallel.compile"):
        watch.after_step(1)
    assert caplog.text == ""  # each reason once

    def scaled(x, k):
        return x * k

    limited = torch.compile(scaled, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2, automatic_dynamic_shapes=False):
        for k in range(4):  # a new constant each call: the third is past the limit and runs eagerly
            limited(torch.ones(2), k)
    with caplog.at_level(logging.WARNING, logger="disttrain_core.parallel.compile"):
        watch.after_step(5)
    metrics = watch.metrics()
    assert metrics["compile/eager_fallbacks"] == 1 and "ran eagerly" in caplog.text, caplog.text
    assert metrics["compile/recompiles"] >= 1 and "more graph(s) at step 5" in caplog.text
