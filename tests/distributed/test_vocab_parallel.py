"""The vocabulary-parallel embedding, head and loss (models/vocab_parallel.py, parallel/tensor_parallel.py).

On 2 gloo ranks: the loss and the gradients of the hidden states and the head equal the whole-vocabulary
``F.cross_entropy`` (fp32, with and without model.loss_chunk, labels -100 included); the gathered logits equal
the whole head's; the embedding's lookups and gradient equal nn.Embedding's, its gradient held as this rank's
rows; each rank's peak live bytes of the head's forward and backward are half or less of the replicated head's
(the allocator's events). Training: llama_tiny at parallel.tp=2 matches one process over 5 steps (mllm_tiny at
tp=2 is tests/distributed/test_units.py's disagg4_tp2)."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .spawn import start_processes
from .test_units import SMALL, assert_same_run, train

pytestmark = pytest.mark.distributed

WORLD = 2


def _head(dim: int, vocab: int, chunk: int, seed: int = 0):
    from disttrain_core.models.head import LMHead

    head = LMHead(dim, vocab, bias=False)
    head.chunk = chunk
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, dim, generator=torch.Generator().manual_seed(seed)) * 0.1)
    return head


def _vocab_parallel(head, mesh):
    from types import SimpleNamespace

    from disttrain_core.parallel.tensor_parallel import apply_vocab_parallel

    holder = SimpleNamespace(cfg=SimpleNamespace(vocab_size=head.weight.shape[0]), tok_embeddings=None, output=head)
    apply_vocab_parallel(holder, mesh)
    return head


def _init(rank: int, store: str):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dist.group.WORLD, "cpu")


def _equality_worker(rank: int, store: str, out: str) -> None:
    mesh = _init(rank, store)
    dim, vocab, n = 16, 96, 50
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, dim, generator=g)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::7] = -100
    errors = {}
    for chunk in (0, 16):
        whole = _head(dim, vocab, 0)
        h_ref = hidden.clone().requires_grad_(True)
        logits = F.linear(h_ref, whole.weight)
        reference = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        reference.backward()
        split = _vocab_parallel(_head(dim, vocab, chunk), mesh)
        h = hidden.clone().requires_grad_(True)
        loss = split(h, labels)
        loss.backward()
        errors[f"loss/{chunk}"] = abs(loss.item() - reference.item()) / reference.item()  # a sum of ~40 losses
        errors[f"hidden/{chunk}"] = (h.grad - h_ref.grad).abs().max().item()
        errors[f"weight/{chunk}"] = (split.weight.grad.full_tensor() - whole.weight.grad).abs().max().item()
        errors[f"logits/{chunk}"] = (split(hidden) - logits.detach()).abs().max().item()
    # the embedding: its lookups summed over the ranks; its gradient this rank's rows only
    from disttrain_core.models.vocab_parallel import vocab_parallel_embedding

    whole = torch.nn.Embedding(vocab, dim)
    split = _vocab_parallel(_head(dim, vocab, 0), mesh)  # any [vocab, dim] DTensor parameter
    with torch.no_grad():
        whole.weight.copy_(split.weight.full_tensor())
    tokens = labels.clamp(min=0).view(5, 10)
    upstream = torch.randn(5, 10, dim, generator=g)
    (whole(tokens) * upstream).sum().backward()
    rows = vocab_parallel_embedding(tokens, split.weight, mesh)
    (rows * upstream).sum().backward()
    local = split.weight.grad.to_local()
    errors["embedding"] = (rows - whole(tokens)).abs().max().item()
    errors["embedding_grad"] = (split.weight.grad.full_tensor() - whole.weight.grad).abs().max().item()
    errors["embedding_grad_rows"] = float(local.shape[0] != vocab // WORLD)
    torch.save(errors, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def _peak_worker(rank: int, store: str, out: str) -> None:
    from disttrain_core.train.memory_report import allocation_peak

    mesh = _init(rank, store)
    dim, vocab, n = 64, 16384, 1024
    hidden = torch.randn(n, dim, generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(3))
    peaks = {}
    for name in ("replicated", "vocab_parallel"):
        head = _head(dim, vocab, 0)
        if name == "vocab_parallel":
            _vocab_parallel(head, mesh)
        h = hidden.clone().requires_grad_(True)
        result: dict = {}
        with allocation_peak(result):
            head(h, labels).backward()
        peaks[name] = result["peak_delta"]
    torch.save(peaks, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def _run(worker, tmp_path):
    start_processes(worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD)
    return [torch.load(tmp_path / f"{rank}.pt") for rank in range(WORLD)]


def test_the_vocabulary_parallel_loss_equals_the_whole_vocabulary_loss(tmp_path):
    for errors in _run(_equality_worker, tmp_path):
        assert max(errors.values()) < 1e-5, errors


def test_each_rank_holds_half_the_logits_bytes_at_its_peak(tmp_path):
    """1,024 positions x 16,384 entries: the replicated head's step peaks at its [positions, vocabulary] fp32
    logits, their log-softmax and its gradient (3x the logits, measured); the vocabulary-parallel one at its
    half of the shifted logits and their exponentials (1x: a third of the replicated peak, measured)."""
    for peaks in _run(_peak_worker, tmp_path):
        logits = 1024 * 16384 * 4
        assert peaks["replicated"] >= 2 * logits, peaks
        assert peaks["vocab_parallel"] <= 0.5 * peaks["replicated"], peaks


@pytest.fixture(scope="module")
def llama_reference(one_process):
    return one_process("model=llama_tiny", *SMALL)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sequence_parallel", "plain_tp"])
def test_llama_tp2_with_the_vocabulary_parallel_head_and_chunked_loss_matches_one_process(
    shards, tmp_path, llama_reference, sequence_parallel
):
    """llama_tiny (384 entries: 192 per rank) at tp=2, model.loss_chunk=100 on the split head, against one process
    with the whole head and no chunks; with sequence parallelism (the default) and without."""
    split = train(
        shards,
        tmp_path / "tp2",
        "model=llama_tiny",
        *SMALL,
        "parallel=megatron_tp2",
        "parallel.modality_stages=folded",
        "schedule=none",
        "trainer.devices=2",
        "model.loss_chunk=100",
        f"parallel.sequence_parallel={str(sequence_parallel).lower()}",
    )
    assert_same_run(split, llama_reference)
