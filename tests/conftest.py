"""Shared fixtures: small shards, composed configs with tiny shapes, and a
helper that runs ``train.py`` in a subprocess with an outer timeout."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Tests must not touch the user's cache and must leave cores to each other. What is computed (the planner's
# workloads, FLOP counts, compiled kernels: pure functions of their keys, written atomically) is shared by the
# pytest-xdist workers, so a 72B workload is counted once per machine, not once per worker; what is measured
# (profiles, matmul peaks) stays one cache per worker: two workers never race on one profile or peak file.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
_TMP = Path(os.environ.get("TMPDIR", "/tmp"))
os.environ.setdefault("DISTTRAIN_CACHE", str(_TMP / "disttrain-test-cache"))
os.environ.setdefault("DISTTRAIN_MEASURED_CACHE", str(_TMP / f"disttrain-test-cache-{_WORKER}"))
os.environ.setdefault("OMP_NUM_THREADS", "2")
# trainer.compile's kernels (tests/distributed/test_compile.py): one inductor cache for the session's runs, so a
# block graph compiled by one test (a cold compile: tens of seconds on two cores) is loaded by the next
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(os.environ["DISTTRAIN_CACHE"]) / "inductor"))
# More threads than cores whenever two tests (pytest-xdist) or several ranks share the two cores: OpenMP's
# default spin-wait then burns the cores the other processes need (two parity files ran 149 s with it, 42 s
# without). Waiting threads sleep instead; no kernel computes differently. Read when libgomp loads: here,
# before torch is imported, and inherited by every process a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Point-to-point transfers keep NCCL's contract on gloo too: one handle per batch_isend_irecv call, received
# data valid only once it is waited on (disttrain_core/comm/p2p.py). A wait that NCCL would need fails here.
os.environ.setdefault("DISTTRAIN_STRICT_P2P", "1")

# Shrinks every large model config to CPU-test size while keeping its structure
# (GQA ratios, vocabulary, U-Net levels and cross-attention pattern).
TINY_SHAPES = {
    "llm": ["model.llm.n_layers=2", "model.llm.ffn_dim=128", "model.seq_len=128"],
    "encoder": [
        "model.encoder.image_size=32",
        "model.encoder.patch_size=8",
        "model.encoder.dim=32",
        "model.encoder.n_layers=1",
        "model.encoder.n_heads=2",
        "model.encoder.mlp_dim=64",
        "model.encoder.output_dim=32",
    ],
    "generator": [
        "model.generator.block_out_channels=[16,32,32,32]",
        "model.generator.head_dim=8",
        "model.generator.norm_groups=8",
        "model.generator.cross_attention_dim=32",
        "model.generator.layers_per_block=1",
        "model.gen_image_size=64",
        "model.gen_tokens=4",
    ],
}


# One microbatch of 2 per replica, for mllm_small's runs: under bf16 autocast on a CPU without native bf16 (AVX2
# only, no AVX512: torch's reference gemm), its 16-sample steps took about 100 s each on an Intel Xeon and 215 s on
# an AMD EPYC (the golden-loss run of mllm_small_bf16, 3 steps: 646 s); a bf16 matmul there is 4.5-71x an fp32 one
# by operand layout (docs/performance/test_suite.md). It keeps what a recipe is about: its processes, precision and
# fp32 masters.
SMALL_BATCH = ["optim.global_batch_size=4", "optim.micro_batch_size=2"]


def tiny_overrides(cfg) -> list[str]:
    """Overrides that make any composed model small enough to train in a test."""
    out = []
    llm = cfg.model.llm
    if llm.dim > 512:
        heads = 2 * (llm.n_heads // llm.n_kv_heads)  # two KV heads, same grouping ratio
        out += TINY_SHAPES["llm"] + [
            f"model.llm.n_heads={heads}",
            "model.llm.n_kv_heads=2",
            f"model.llm.dim={16 * heads}",
            "model.llm.vocab_size=384",
        ]
        if llm.moe is not None:  # experts as narrow as the dense feed-forward above
            out.append("model.llm.moe.expert_ffn_dim=64")
    if cfg.model.encoder is not None and cfg.model.encoder.dim > 256:
        out += TINY_SHAPES["encoder"]
    if cfg.model.generator is not None and cfg.model.generator.block_out_channels[0] > 64:
        out += TINY_SHAPES["generator"]
    if cfg.model.reference_global_batch > 64:  # large presets carry their planning batch
        out += ["optim.global_batch_size=16", "optim.micro_batch_size=8"]
    return out


@pytest.fixture(autouse=True)
def no_stale_rendezvous(monkeypatch):
    """Fabric's launcher exports MASTER_PORT into the process that launches; a later launch in the same test
    process would reuse that port, which, with tests running side by side (pytest-xdist), another test's
    process may have taken since. Each test starts without it."""
    monkeypatch.delenv("MASTER_PORT", raising=False)


def shared_dir(tmp_path_factory) -> Path:
    """A directory every pytest-xdist worker of this test session sees (the session's own under one process)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def made_once(directory: Path):
    """``with made_once(d) as todo:`` -- ``todo`` is true for the one process (of the session's workers) that must
    make ``d``'s contents; the others wait for it to finish, then find them made."""
    import fcntl

    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{directory}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = Path(f"{directory}.done")
        todo = not done.exists()
        yield todo
        if todo:
            done.touch()


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> Path:
    """4 equal shards x 24 samples with small images, generated once per test session and shared by the workers
    (the data is a pure function of its seed: both workers would make the same bytes)."""
    from disttrain_core.config import SyntheticDataConfig
    from disttrain_core.data.synthetic import generate_shards

    out = shared_dir(tmp_path_factory) / "data" / "shards"
    with made_once(out) as todo:
        if todo:
            config = SyntheticDataConfig(num_shards=4, samples_per_shard=24, image_side_max=128)
            generate_shards(config, out, processes=1)
    return out


@pytest.fixture(scope="session")
def val_shards(shards) -> Path:
    """The held-out split beside ``shards`` (data.val.path's default: <data.path>_val): 1 shard x 24 other
    samples of the same generator."""
    from disttrain_core.config import SyntheticDataConfig
    from disttrain_core.data.synthetic import generate_shards

    out = Path(f"{shards}_val")
    with made_once(out) as todo:
        if todo:
            config = SyntheticDataConfig(num_shards=4, samples_per_shard=24, image_side_max=128, val_shards=1)
            generate_shards(config, out, processes=1, held_out=True)
    return out


def base_overrides(shards: Path, run_dir: Path) -> list[str]:
    return [
        f"data.path={shards}",
        "data.generate_if_missing=false",
        "data.num_workers=0",
        f"paths.output_dir={run_dir}",
        "trainer.accelerator=cpu",
        "trainer.progress_bar=false",
        "trainer.log_every_n_steps=1",
        "cluster.peak_flops_fp32=1e11",
        "cluster.peak_flops_bf16=4e11",
    ]


def cli_overrides(shards: Path, run_dir: Path) -> list[str]:
    """Like base_overrides, for ``python train.py``: Hydra owns the run directory."""
    return [o for o in base_overrides(shards, run_dir) if not o.startswith("paths.output_dir")] + [
        f"hydra.run.dir={run_dir}"
    ]


@pytest.fixture
def compose_cfg(shards, tmp_path):
    from disttrain_core.config import compose

    def make(*overrides: str, run_dir: Path | None = None):
        return compose(base_overrides(shards, run_dir or tmp_path / "run") + list(overrides))

    return make


_ZYGOTE = None


def warm_interpreter():
    """The session's warm interpreter for train.py runs (tests/zygote.py), started on first use."""
    global _ZYGOTE
    if _ZYGOTE is None or not _ZYGOTE.alive():
        from .zygote import Zygote

        _ZYGOTE = Zygote()
    return _ZYGOTE


# The order files are handed to pytest-xdist's workers (make test: -n 2 --dist loadfile): the long,
# few-test directories first, the many short unit files last, where they fill the gaps until both workers
# finish together (longest first). Within a directory the order is pytest's.
_FIRST = ("faults", "recipes", "distributed", "unit")


# Every collected test's node id -> whether it is marked slow, taken before ``-m "not slow"`` deselects any:
# tests/recipes/test_readme.py resolves the README's "proved by" names to these cases.
COLLECTED_SLOW: dict[str, bool] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """Collection imports torch, Hydra and every test module without the garbage collector and freezes what they
    made (disttrain_core/base/startup.py): later collections in this process walk only what the tests make. The
    suite's own process spent about 40% of its CPU in the collector before."""
    from disttrain_core.base.startup import uncollected_imports

    with uncollected_imports():
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    COLLECTED_SLOW.update({item.nodeid: item.get_closest_marker("slow") is not None for item in items})

    def rank(item) -> int:
        parts = Path(str(item.fspath)).relative_to(REPO).parts
        return _FIRST.index(parts[1]) if len(parts) > 2 and parts[1] in _FIRST else len(_FIRST)

    items.sort(key=rank)  # stable: pytest's order inside each directory


def pytest_sessionfinish(session, exitstatus):
    if _ZYGOTE is not None:
        _ZYGOTE.close()


def run_script(
    script: Path, args: list[str], timeout: float = 240, cwd: Path = REPO, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``python script args...`` with an outer timeout; output captured. The run is a fork of the session's
    warm interpreter (tests/zygote.py), or a fresh interpreter with ``DISTTRAIN_TEST_COLD=1``."""
    env = dict(os.environ) if env is None else env
    started = time.perf_counter()
    if os.environ.get("DISTTRAIN_TEST_COLD") != "1":
        import tempfile

        with tempfile.TemporaryDirectory(prefix="run-") as scratch:
            result = warm_interpreter().run(Path(script), [str(a) for a in args], cwd, env, timeout, Path(scratch))
    else:
        result = subprocess.run(
            [sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    log_run(Path(script).name, [str(a) for a in args], time.perf_counter() - started)
    return result


def log_run(script: str, args: list[str], seconds: float) -> None:
    """With ``DISTTRAIN_TEST_RUNLOG=<file>``: one JSON line per script run or process group a test starts (the
    test, what ran, its seconds), for ``tools/test_times.py runs=<file>``: where the suite's time goes."""
    path = os.environ.get("DISTTRAIN_TEST_RUNLOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
        record = {"test": test, "script": script, "args": args, "seconds": round(seconds, 3)}
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")


def run_train(args: list[str], timeout: float = 240, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``python train.py args...`` (``run_script``), unbuffered, with Hydra's full errors."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}
    return run_script(REPO / "train.py", args, timeout, cwd, env)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def write_tar(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> None:
    """A webdataset shard: each sample's members as ``<key>.<extension>``, in order."""
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
