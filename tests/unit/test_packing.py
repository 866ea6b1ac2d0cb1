"""Variable-length text (data/packing.py): HotSPa's bucketing and greedy packing, packed rows with document
ids and positions, the long-tail length profiles, and the model side: a document's loss and gradients
packed with others equal those of the document run alone (fp32, 1e-5)."""

import pytest
import torch
import torch.nn.functional as F

from disttrain_core.data.packing import IGNORE, bucket_and_pack, pack, pack_rows, sample_lengths


def test_buckets_split_at_boundaries_and_pack_longest_first_then_from_the_shortest_end():
    lengths = [7, 12, 3, 30, 9, 5, 16]
    buckets = bucket_and_pack(lengths, [16, 32])
    assert [b.capacity for b in buckets] == [16, 32]
    # bucket (0, 16]: order 6(16) 1(12) 4(9) 0(7) 5(5) 2(3); row of 16 is full; 12 + 3 = 15; 9 + 5 = 14; 7
    assert buckets[0].rows == [[6], [1, 2], [4, 5], [0]]
    assert buckets[1].rows == [[3]]
    assert sorted(buckets[0].documents + buckets[1].documents) == list(range(len(lengths)))
    assert bucket_and_pack([], [8])[0].rows == []  # an empty bucket is kept
    for rows, capacity in ((pack(list(range(7)), lengths, 40), 40),):
        assert all(sum(lengths[i] for i in row) <= capacity for row in rows)


def test_bad_boundaries_and_documents_beyond_the_last_are_refused():
    with pytest.raises(ValueError, match="longer than the last bucket boundary 16: add a boundary >= 30"):
        bucket_and_pack([3, 30], [8, 16])
    for bad in ([], [16, 8], [8, 8], [1]):
        with pytest.raises(ValueError, match="strictly ascending"):
            bucket_and_pack([3], bad)
    with pytest.raises(ValueError, match="more than its capacity 8"):
        pack_rows([torch.arange(5), torch.arange(5)], [[0, 1]], 8)


def test_packed_rows_reset_positions_and_never_predict_across_documents():
    docs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6, 7, 8, 9])]
    rows = pack_rows(docs, [[0, 1], [2]], 6, pad_id=0)
    assert rows.tokens.tolist() == [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]]
    assert rows.labels.tolist() == [[2, 3, IGNORE, 5, IGNORE, IGNORE], [7, 8, 9, IGNORE, IGNORE, IGNORE]]
    assert rows.doc_ids.tolist() == [[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]]
    assert rows.positions.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    assert rows.real_tokens == 9


def test_length_profiles_are_long_tailed_and_deterministic():
    g = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    web = torch.tensor(sample_lengths("commoncrawl", 20000, 32768, g()), dtype=torch.float)
    code = torch.tensor(sample_lengths("github", 20000, 32768, g()), dtype=torch.float)
    assert sample_lengths("github", 50, 32768, g()) == sample_lengths("github", 50, 32768, g())
    for lengths, median, beyond_4k in ((web, 660, 0.08), (code, 1450, 0.18)):
        assert abs(lengths.median().item() / median - 1) < 0.1
        assert abs((lengths > 4096).float().mean().item() - beyond_4k) < 0.015
        assert lengths.min() >= 2 and lengths.max() <= 32768
        assert lengths.mean() > 2 * lengths.median()  # long tail: the mean sits far above the median
    with pytest.raises(ValueError, match="allowed values are commoncrawl, github"):
        sample_lengths("wiki", 1, 8, g())


def test_a_scaled_profile_keeps_its_shape_where_clamping_does_not():
    """1/32 of the 32K profile, drawn up to 1K, has the 32K draw's token shares per relative length band;
    clamping the unscaled profile at 1K piles most tokens onto the longest band."""
    g = lambda: torch.Generator().manual_seed(2)  # noqa: E731
    full = sample_lengths("commoncrawl", 20000, 32768, g())
    scaled = sample_lengths("commoncrawl", 20000, 1024, g(), scale=1 / 32)
    clamped = sample_lengths("commoncrawl", 20000, 1024, g())

    def long_share(lengths, edge):  # the share of tokens in documents longer than edge
        return sum(n for n in lengths if n > edge) / sum(lengths)

    for edge in (64, 128, 512):
        assert abs(long_share(scaled, edge) - long_share(full, 32 * edge)) < 0.03
    assert long_share(clamped, 512) > 0.7 > 0.4 > long_share(scaled, 512)
    with pytest.raises(ValueError, match="must be positive"):
        sample_lengths("github", 1, 8, g(), scale=0.0)


def test_a_token_budget_sets_rows_per_microbatch_per_bucket():
    from types import SimpleNamespace

    from disttrain_core.data.packed_loader import replica_rows, text_batch
    from disttrain_core.data.packing import microbatch_rows

    budget = SimpleNamespace(rows_per_microbatch=1, tokens_per_microbatch=512)
    assert [microbatch_rows(budget, c) for c in (64, 128, 512, 1024)] == [8, 4, 1, 1]
    rows = SimpleNamespace(rows_per_microbatch=3, tokens_per_microbatch=None)
    assert [microbatch_rows(rows, c) for c in (64, 1024)] == [3, 3]
    short = text_batch(pack_rows([torch.arange(2, 6)] * 5, [[k] for k in range(5)], 4))  # 5 rows of 4 tokens
    long = text_batch(pack_rows([torch.arange(2, 10)], [[0]], 8))  # 1 row of 8
    for replica in range(2):
        mbs = replica_rows([short, long], [2, 1], replicas=2, replica=replica)
        # short: 5 rows in slots of 2 x 2 -> 2 slots (the second padded); long: one slot of 1 x 2 (padded)
        assert [mb.tokens.shape for mb in mbs] == [(2, 4), (2, 4), (1, 8)]
    first = replica_rows([short, long], [2, 1], replicas=2, replica=0)
    assert (first[0].tokens == short.tokens[:2]).all() and (first[2].tokens == long.tokens).all()


def _llama(seq_len):
    from disttrain_core.config import LlamaConfig
    from disttrain_core.models.common import init_weights
    from disttrain_core.models.llama import Llama

    model = Llama(
        LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, rope_theta=1e4), seq_len
    )
    init_weights(model, seed=3, std=0.05)
    return model


@pytest.mark.parametrize("kernel", ["dense", "varlen"])
def test_a_packed_document_has_the_loss_and_gradients_it_has_alone(kernel):
    """model.document_attention: the dense [S, S] mask and one causal SDPA per document."""
    from disttrain_core.models.llama import Documents

    g = torch.Generator().manual_seed(0)
    lengths = [7, 12, 3, 30, 9, 5]
    docs = [torch.randint(0, 64, (n,), generator=g) for n in lengths]
    alone_model, packed_model = _llama(32), _llama(32)
    for layer in packed_model.layers.values():
        layer.attention.document_kernel = kernel
    alone_total = 0.0
    for doc in docs:
        alone_total = alone_total + F.cross_entropy(alone_model(doc[None])[0, :-1], doc[1:], reduction="sum")
    alone_total.backward()
    packed_total = 0.0
    for bucket in bucket_and_pack(lengths, [16, 32]):
        rows = pack_rows(docs, bucket.rows, bucket.capacity)
        logits = packed_model(rows.tokens, Documents(rows.doc_ids, rows.positions))
        per_position = F.cross_entropy(logits.flatten(0, 1), rows.labels.flatten(), reduction="none").view(
            rows.labels.shape
        )
        for i in bucket.documents:  # each document on its own
            doc = docs[i]
            alone = F.cross_entropy(alone_model(doc[None])[0, :-1], doc[1:], reduction="sum")
            assert abs(per_position[rows.doc_ids == i].sum().item() - alone.item()) < 1e-5 * alone.item()
        packed_total = packed_total + per_position.sum()
    packed_total.backward()
    assert abs(packed_total.item() - alone_total.item()) < 1e-5 * alone_total.item()
    for (name, p), (_, q) in zip(packed_model.named_parameters(), alone_model.named_parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() < 1e-5, name
    # without the document mask the same rows give other losses: the mask is what makes them agree
    rows = pack_rows(docs, [[1, 2]], 16)
    masked = packed_model(rows.tokens, Documents(rows.doc_ids, rows.positions))
    assert not torch.allclose(masked, packed_model(rows.tokens), atol=1e-4)
