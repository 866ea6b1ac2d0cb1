"""A pool of producers (data.producer.count): each plans every sample of a step and decodes only its share of
the data-parallel groups; the trainers join the shares. The global batches do not depend on the number of
producers or of their decode workers, a run resumed with another number continues with the exact next samples,
and a producer that dies and comes back on its address loses and repeats nothing."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from disttrain_core.data.producer import Layout, ProducerLoader, ProducerServer, job_identity, share_of
from disttrain_core.data.producer_client import ProducerPool, pool_connections
from disttrain_core.data.producer_protocol import FIELDS, ProtocolError, parse_hello
from disttrain_core.data.transport import load_key, new_key

from .test_producer import free_port

pytestmark = pytest.mark.distributed

# Three data-parallel groups of two samples per slot; trainers: three replicas of one rank each (one group
# each), and one trainer of a dp=1 unit whose block is the whole slot (it fetches from every producer).
LAYOUT = Layout(slots=2, samples_per_slot=6, groups=3, stages=2, world=4)
BLOCKS = [range(0, 2), range(2, 4), range(4, 6), range(0, 6)]


class Pool:
    """``count`` ProducerServers on threads of this process, on fixed ports (a restart reuses one)."""

    def __init__(self, cfg, key: str, count: int):
        self.cfg, self.key = cfg, key
        self.ports = [free_port() for _ in range(count)]
        self.servers = [self.start(p) for p in range(count)]

    def start(self, p: int) -> ProducerServer:
        server = ProducerServer(self.cfg, load_key(self.key), f"127.0.0.1:{self.ports[p]}")
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    def trainers(self, layout: Layout, start: dict | None = None) -> list[ProducerPool]:
        blocks = [(block, 1) for block in BLOCKS]
        return [
            ProducerPool(
                self.addresses,
                load_key(self.key),
                layout,
                start,
                30.0,
                1 << 26,
                pool_connections(len(self.ports), layout, block, blocks),
            )
            for block in BLOCKS
        ]

    def close(self) -> None:
        for server in self.servers:
            server.close()


def steps(trainers: list[ProducerPool], n: int) -> list[list]:
    """``n`` steps: per step, the three replicas' slots joined (the whole batch) and the dp=1 trainer's slots."""
    out = []
    for _ in range(n):
        got = [t.next_step() for t in trainers]
        joined = [[got[r][k] for r in range(3)] for k in range(LAYOUT.slots)]
        out.append((joined, got[3]))
    return out


def flat(step) -> list[tuple[str, list, list]]:
    """A step as (key, field values) rows, whatever the trainers that brought them."""
    joined, _ = step
    rows = []
    for parts in joined:
        for part in parts:
            for i in range(part.size):
                one = part.select(range(i, i + 1))
                rows.append((one.keys[0], [getattr(one, name) for name in FIELDS]))
    return rows


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        ka == kb and all(torch.equal(x, y) for x, y in zip(va, vb, strict=True))
        for (ka, va), (kb, vb) in zip(a, b, strict=True)
    )


def run_pool(cfg, count: int, n: int, start: dict | None = None, layout: Layout | None = None):
    key = new_key()
    layout = layout or replace(LAYOUT, job=tuple(sorted(job_identity(cfg).items())))
    pool = Pool(cfg, key, count)
    try:
        trainers = pool.trainers(layout, start)
        got = steps(trainers, n)
        states = [t.state_dict() for t in trainers]
        for t in trainers:
            t.close()
        return got, states
    finally:
        pool.close()


def test_batches_do_not_depend_on_the_number_of_producers_or_decode_workers(compose_cfg):
    """1, 2 and 3 producers, 0, 1 and 3 decode workers: the same samples in the same order with the same tensors,
    every trainer receiving its block (the dp=1 trainer the whole slot, from every producer)."""
    runs = {}
    for count, workers in [(1, 0), (2, 1), (3, 0), (1, 3)]:
        cfg = compose_cfg("data.producer.timeout_s=20", f"data.producer.workers={workers}")
        runs[count, workers], states = run_pool(cfg, count, 3)
        assert all(state == states[0] for state in states)
    reference = runs[1, 0]
    for (count, workers), got in runs.items():
        for step, ref in zip(got, reference, strict=True):
            assert same(flat(step), flat(ref)), (count, workers)
            whole = [(k, [getattr(s, f) for f in FIELDS]) for s in step[1] for k in s.keys]
            assert [k for k, _ in whole] == [k for k, _ in flat(step)]  # the dp=1 trainer: every sample, in order


def test_a_resumed_run_with_another_number_of_producers_continues_exactly(compose_cfg):
    cfg = compose_cfg("data.producer.timeout_s=20", "data.producer.workers=0")
    straight, _ = run_pool(cfg, 1, 4)
    first, states = run_pool(cfg, 2, 2)
    resumed, _ = run_pool(cfg, 3, 2, start={**states[0], "step": 2})
    for got, ref in zip(first + resumed, straight, strict=True):
        assert same(flat(got), flat(ref))


def test_a_producer_that_dies_and_returns_on_its_address_loses_and_repeats_nothing(compose_cfg):
    """Producer 1 of 2 (samples 2-5 of every slot) closes when two of its three trainers have fetched step 3, and
    listens again on its port 0.5 s later. Its trainers come back one step apart: the two that had step 3 first,
    then the one that had not. The new producer starts the stream at the earliest (step 2) and checks the others
    against it; every trainer receives the uninterrupted run's samples."""
    cfg = compose_cfg("data.producer.timeout_s=20", "data.producer.workers=0")
    reference, _ = run_pool(cfg, 1, 5)
    layout = replace(LAYOUT, job=tuple(sorted(job_identity(cfg).items())))
    pool = Pool(cfg, new_key(), 2)
    try:
        trainers = pool.trainers(layout)
        got: list[list] = [[t.next_step() for _ in range(2)] for t in trainers]
        for i in (0, 1, 3):  # trainer 2 has not fetched step 3 yet
            got[i].append(trainers[i].next_step())
        pool.servers[1].close()
        time.sleep(0.5)
        pool.servers[1] = pool.start(1)
        errors = []

        def finish(i: int, delay: float) -> None:
            try:
                time.sleep(delay)
                while len(got[i]) < 5:
                    got[i].append(trainers[i].next_step())
            except Exception as error:  # reported below
                errors.append(f"trainer {i}: {error}")

        threads = [threading.Thread(target=finish, args=(i, 0.0 if i != 2 else 0.3)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, errors
        assert sum(t.reconnects for t in trainers) >= 3
        for step, ref in enumerate(reference):
            joined = [[got[r][step][k] for r in range(3)] for k in range(LAYOUT.slots)]
            assert same(flat((joined, got[3][step])), flat(ref)), step
    finally:
        pool.close()


def test_shares_cover_whole_groups_and_a_trainer_asks_only_inside_its_producers_share(compose_cfg):
    layout = Layout(slots=1, samples_per_slot=12, groups=4, stages=1, world=4)
    assert [share_of(layout, p, 3) for p in range(3)] == [range(0, 3), range(3, 6), range(6, 12)]
    assert [share_of(layout, p, 4) for p in range(4)] == [range(3 * p, 3 * p + 3) for p in range(4)]
    with pytest.raises(ValueError, match="at most one producer per data-parallel group \\(4 here\\)"):
        share_of(layout, 0, 5)
    # a dp=1 trainer (whole slot) and two dp=2 replicas, with a pool of 2: who fetches from whom
    blocks = [(range(0, 12), 2), (range(0, 6), 1), (range(6, 12), 1)]
    assert pool_connections(2, layout, range(0, 12), blocks) == [(0, range(0, 6), 3), (1, range(6, 12), 3)]
    assert pool_connections(2, layout, range(6, 12), blocks) == [(1, range(6, 12), 3)]
    hello = {"layout": layout.to_dict(), "start": {}, "trainer": "t", "block": [0, 3]}
    assert parse_hello({**hello, "pool": [1, 4]})[5] == (1, 4)
    for bad in ([4, 4], [0, 5], [0], "0/2"):
        with pytest.raises(ProtocolError, match="bad pool in HELLO"):
            parse_hello({**hello, "pool": bad})
    cfg = compose_cfg("data.producer.timeout_s=5", "data.producer.workers=0")
    layout = replace(LAYOUT, job=tuple(sorted(job_identity(cfg).items())))
    key = new_key()
    pool = Pool(cfg, key, 2)
    try:
        with pytest.raises(RuntimeError, match="serves samples 0-1 of every slot; the trainer asked for samples 0-3"):
            ProducerLoader(pool.addresses[0], load_key(key), layout, {}, 5.0, 1 << 26, range(0, 4), None, (0, 2))
    finally:
        pool.close()


DISAGG = ["parallel=disagg2", "parallel.units.encoder.dp=2", "parallel.units.llm.dp=2", "trainer.devices=4"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.producer.count=3"], "data.producer.count=3: a pool serves whole data-parallel groups, and this layout"),
        (["data.producer.address=[a:1,b:2,c:3]"], "data.producer.count=3: a pool serves whole data-parallel groups"),
        (["data.producer.count=2", "data.producer.per_rank=false"], "per_rank=false (every trainer the whole batch)"),
        (["data.producer.count=2", "data.producer.listen=127.0.0.1:7000"], "need port 0"),
        (["data.producer.count=0"], "data.producer.count=0: use 1 or more"),
        (["data.producer.address=[a:1,b:2]", "data.producer.count=3"], "names 2 producer(s)"),
        (["data.producer.address=[a:1,nohost]"], "data.producer.address='nohost': use HOST:PORT"),
    ],
)
def test_a_pool_that_cannot_work_is_refused_in_one_line(overrides, message):
    from disttrain_core.config import compose, typed_config
    from disttrain_core.planner.fit import validate_run
    from disttrain_core.validation import ConfigError

    with pytest.raises(ConfigError) as error:
        validate_run(typed_config(compose([*DISAGG, "data.producer.workers=1", *overrides])))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_sample_whose_pixels_do_not_decode_keeps_its_place_with_no_loss(compose_cfg, tmp_path):
    """Its header read (so every producer planned the step with it), its body did not: it stays, zeroed and
    without loss, counted in the producer's log."""
    import io

    from PIL import Image

    from disttrain_core.data.producer import BatchAssembler

    from ..conftest import write_tar

    def jpeg(seed: int) -> bytes:  # noise: a long scan after the headers
        import numpy as np

        pixels = np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG")
        return buffer.getvalue()

    data = tmp_path / "broken"
    data.mkdir()
    samples = [(f"{i:03d}", {"jpg": jpeg(i), "txt": f"sample {i}".encode()}) for i in range(8)]
    body = samples[3][1]["jpg"]
    samples[3][1]["jpg"] = body[: len(body) // 2]  # the headers, then half the scan
    write_tar(data / "a.tar", samples)
    cfg = compose_cfg(f"data.path={data}", "data.producer.workers=0")
    layout = Layout(slots=1, samples_per_slot=8, groups=2, stages=1, world=1)
    assembled = BatchAssembler(cfg, layout, {}, (1, 2)).next()
    whole = BatchAssembler(cfg, layout, {}).next()
    broken = whole.batch.keys.index("a.tar/003")
    assert whole.batch.image_counts[broken] == 1 and not whole.batch.images[broken].any()
    assert (whole.batch.labels[broken] == -100).all() and whole.batch.gen_weight[broken] == 0
    assert torch.equal(assembled.summary.image_counts, whole.summary.image_counts)
    assert assembled.batch.keys == whole.batch.keys[4:]  # the second producer's half
    assert torch.equal(assembled.batch.tokens, whole.batch.tokens[4:])
