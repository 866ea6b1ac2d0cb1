"""Dataset blends (data.blend, data/blend.py): each source's share, a pure function of the index, exact resume,
and one-line errors for bad weights and sources."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from disttrain_core.config import SyntheticDataConfig
from disttrain_core.data.blend import BlendedStream, blend_counts, blend_sources, normalized, open_stream
from disttrain_core.data.reader import Position, RawSample, ShardStream, resolve_shards
from disttrain_core.data.synthetic import generate_shards
from disttrain_core.validation import ConfigError
from disttrain_core.validation.settings import validate_data


def test_each_source_gets_its_share_within_one_percent_over_ten_thousand_samples():
    for weights in ([0.7, 0.3], [7, 3], [0.5, 0.0, 0.25, 0.25]):
        w = normalized(weights)
        sources = blend_sources(w, 0, 10_000)
        counts = np.bincount(sources, minlength=len(w))
        assert np.all(np.abs(counts / 10_000 - w) < 0.01), (weights, counts)
        assert np.array_equal(counts, blend_counts(w, 10_000))
        for n in (1, 17, 999, 10_000):  # at every length, not only at the end: within a few samples
            assert np.all(np.abs(blend_counts(w, n) - n * w) <= 3), n
    # the source of sample i does not depend on where one starts counting
    w = normalized([0.7, 0.3])
    assert np.array_equal(blend_sources(w, 0, 500)[123:], blend_sources(w, 123, 377))
    with pytest.raises(ValueError, match=r"blend weights \[0.0, 0.0\]"):
        normalized([0.0, 0.0])
    with pytest.raises(ValueError, match=r"blend weights \[0.5, -0.1\]"):
        normalized([0.5, -0.1])


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two sources of 16 and 24 small samples (2 and 3 shards): a run of 100 passes several epochs of both."""
    out = []
    for name, shards in (("a", 2), ("b", 3)):
        path = tmp_path_factory.mktemp(f"blend_{name}")
        generate_shards(SyntheticDataConfig(num_shards=shards, samples_per_shard=8, image_side_max=32), path, 1)
        out.append(path)
    return out


def keys(elements, count: int) -> list[tuple[int, str]]:
    return [(e.position.index, e.item.key) for e in itertools.islice(elements, count)]


def test_a_blend_streams_its_sources_and_resumes_exactly_anywhere(sources):
    streams = [ShardStream(resolve_shards(str(p)), 0, 1, seed=3) for p in sources]
    blend = BlendedStream(streams, [0.7, 0.3], ["a", "b"])
    straight = keys(blend.elements(), 100)
    assert [i for i, _ in straight] == list(range(100))
    picked = [key.split(":", 1)[0] for _, key in straight]
    assert picked == ["ab"[s] for s in blend_sources(blend.weights, 0, 100)]
    # within each source, its own stream's order, epoch after epoch
    alone = [e.item.key for e in itertools.islice(streams[0].elements(), picked.count("a"))]
    assert [key.split(":", 1)[1] for _, key in straight if key.startswith("a:")] == alone
    for start in (1, 23, 41, 77):  # source a's 16-sample epochs end at several of these
        resumed = BlendedStream([ShardStream(resolve_shards(str(p)), 0, 1, seed=3) for p in sources], [7, 3], "ab")
        assert keys(resumed.elements(Position(0, start)), 100 - start) == straight[start:], start
    for source, stream in enumerate(streams):  # from the tar headers, as the stream counts them
        assert blend._epoch_length(source) == sum(1 for _ in stream.epoch_elements(0)) == [16, 24][source]
    assert blend.shares(40) == {"a": picked[:40].count("a") / 40, "b": picked[:40].count("b") / 40}
    # counted on from the last call, and from the start again for an earlier position
    assert blend.shares(100) == {"a": picked.count("a") / 100, "b": picked.count("b") / 100}
    assert blend.shares(7) == {"a": picked[:7].count("a") / 7, "b": picked[:7].count("b") / 7}
    assert all(isinstance(e.item, RawSample) for e in itertools.islice(blend.elements(), 10))


def test_bad_blends_are_one_line_before_launch(compose_cfg, sources):
    a, b = sources
    good = compose_cfg(f"data.blend=[{{path:{a},weight:0.7}},{{path:{b},weight:0.3,name:mmc4}}]")
    validate_data(good)
    assert [s.name for s in good.data.blend] == [None, "mmc4"]
    assert isinstance(open_stream(good.data, 0), BlendedStream)
    cases = {
        f"data.blend=[{{path:{a},weight:-1}},{{path:{b},weight:0.3}}]": r"data.blend weights \[-1.0, 0.3\]: give",
        f"data.blend=[{{path:{a},weight:0}},{{path:{b},weight:0}}]": r"data.blend weights \[0.0, 0.0\]",
        f"data.blend=[{{path:{a},name:x}},{{path:{b},name:x}}]": r"data.blend names \['x', 'x'\]",
        f"data.blend=[{{path:{a}}},{{path:{a}/nowhere}}]": r"data.blend\[1\] \(source1\) path=.*nowhere': no .tar",
    }
    for override, match in cases.items():
        with pytest.raises(ConfigError, match=match):
            validate_data(compose_cfg(override))
    with pytest.raises(ConfigError, match=r"data.blend\[0\] \(source0\) .* has 2 shard\(s\) for 3 data-parallel"):
        validate_data(compose_cfg(f"data.blend=[{{path:{a}}},{{path:{b}}}]"), dp=3)
    refusal = "data.blend mixes shard or data=hf sources; it does not apply to data.format=tokens or data.packing"
    with pytest.raises(ConfigError, match=refusal):
        validate_data(compose_cfg(f"data.blend=[{{path:{a}}}]", "data.packing.enabled=true"))


def test_training_on_a_blend_logs_each_sources_share(sources, shards, tmp_path):
    from ..conftest import cli_overrides, read_metrics, run_train

    a, b = sources
    run_dir = tmp_path / "run"
    blend = f"data.blend=[{{path:{a},weight:0.7,name:laion}},{{path:{b},weight:0.3,name:mmc4}}]"
    result = run_train([*cli_overrides(shards, run_dir), blend, "trainer.max_steps=3", "optim.global_batch_size=8"])
    assert result.returncode == 0, result.stderr[-3000:]
    last = [m for m in read_metrics(run_dir) if "loss" in m][-1]
    assert last["data/blend/laion"] + last["data/blend/mmc4"] == pytest.approx(1.0)
    assert last["data/blend/laion"] == pytest.approx(0.7, abs=0.1)  # 24 samples read: within a few of the weight
