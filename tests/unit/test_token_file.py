"""data.format=tokens (data/token_file.py): windows of a pre-tokenized .npy file, positioned by step."""

import numpy as np
import pytest
import torch

from disttrain_core.data.token_file import SKIP_REASON, TokenFileLoader
from disttrain_core.planner.fit import validate_run
from disttrain_core.validation import ConfigError


def _file(tmp_path, tokens, name="tokens.npy"):
    path = tmp_path / name
    np.save(path, np.asarray(tokens))
    return path


def test_an_epoch_visits_every_window_once_with_next_token_labels(tmp_path):
    seq = 8
    path = _file(tmp_path, np.arange(6 * seq + 1, dtype=np.uint16))  # 6 windows
    loader = TokenFileLoader(path, seq, rows=3, microbatches=1, vocab=1000, seed=5)
    rows = torch.cat([loader.next_step()[0].tokens for _ in range(2)])
    starts = sorted(int(r[0]) for r in rows)
    assert starts == [k * seq for k in range(6)]
    batch = TokenFileLoader(path, seq, 3, 1, 1000, 5).next_step()[0]
    assert torch.equal(batch.labels[:, :-1], batch.tokens[:, 1:])
    assert torch.equal(batch.labels[:, -1], batch.tokens[:, -1] + 1)
    assert batch.tokens.is_contiguous() and batch.labels.is_contiguous() and batch.doc_ids is None
    # the next epoch visits them again, in another order
    third = TokenFileLoader(path, seq, 3, 1, 1000, 5)
    orders = [[int(r[0]) for r in third.next_step()[0].tokens] for _ in range(4)]
    assert sorted(orders[2] + orders[3]) == starts and orders[:2] != orders[2:]


def test_a_step_depends_on_seed_and_step_only_and_resumes_exactly(tmp_path):
    path = _file(tmp_path, np.random.default_rng(0).integers(0, 50, 4000).astype(np.int32))
    straight = TokenFileLoader(path, 16, rows=4, microbatches=2, vocab=50, seed=1)
    steps = [straight.next_step() for _ in range(5)]
    first = TokenFileLoader(path, 16, 4, 2, 50, seed=1)
    for _ in range(3):
        first.next_step()
    resumed = TokenFileLoader(path, 16, 4, 2, 50, seed=1, state=first.state_dict())
    for expected in steps[3:]:
        got = resumed.next_step()
        assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(got, expected, strict=True))
    other = TokenFileLoader(path, 16, 4, 2, 50, seed=2).next_step()
    assert not torch.equal(other[0].tokens, steps[0][0].tokens)


def test_a_window_outside_the_vocabulary_is_skipped_counted_and_replaced(tmp_path):
    tokens = np.zeros(10 * 4 + 1, dtype=np.int64)
    tokens[4 * 3 + 2] = 99  # inside window 3 only
    loader = TokenFileLoader(_file(tmp_path, tokens), 4, rows=9, microbatches=1, vocab=10, seed=0)
    batch = loader.next_step()[0]
    assert batch.size == 9 and int(batch.tokens.max()) < 10
    assert loader.skipped[SKIP_REASON] == 1 and loader.state_dict()["cursor"] == 10


def test_bad_token_files_are_refused_before_launch_in_one_line(compose_cfg, tmp_path):
    good = _file(tmp_path, np.arange(4096, dtype=np.uint16) % 300)
    validate_run(compose_cfg("model=llama_tiny", "data=tokens", f"data.path={good}"))
    cases = {
        "2-D": (_file(tmp_path, np.zeros((4, 600), dtype=np.uint16), "flat.npy"), "1-D integer"),
        "floats": (_file(tmp_path, np.zeros(600, dtype=np.float32), "f.npy"), "1-D integer"),
        "short": (_file(tmp_path, np.zeros(100, dtype=np.uint16), "s.npy"), "fewer than model.seq_len"),
        "vocab": (_file(tmp_path, np.full(600, 5000, dtype=np.uint16), "v.npy"), "token id 5000 outside"),
        "suffix": (tmp_path / "tokens.bin", ".npy file"),
        "absent": (tmp_path / "absent.npy", "no such file"),
    }
    for path, says in cases.values():
        with pytest.raises(ConfigError, match=says):
            validate_run(compose_cfg("model=llama_tiny", "data=tokens", f"data.path={path}"))
    with pytest.raises(ConfigError, match="has an image encoder"):
        validate_run(compose_cfg("model=mllm_tiny", "data=tokens", f"data.path={good}"))
    with pytest.raises(ConfigError, match="data.format='csv'"):
        validate_run(compose_cfg("model=llama_tiny", "data.format=csv"))
