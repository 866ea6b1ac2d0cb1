"""The layout is resolved in one place, once per ``launch()`` (parallel/resolved.py ``resolve_run``).

A real ``python train.py`` (a fresh interpreter, not the suite's warm one) runs with a ``sitecustomize`` that
wraps the resolver (``resolve_run``) and the unit resolver under it (``parallel.plan.units_of``) in every
process of the job -- train.py, its fork server and the ranks forked from it -- and appends one line per
call to a file: which function, and whether the call came from inside ``launch()``, from train.py's argument
check before Hydra runs the job (``preflight``), or from a rank. A disaggregated run (``parallel=disagg2``: an
encoder unit and an LLM unit) and a HotSPa run (three buckets, two strategies) each resolve exactly once
inside ``launch()``; no rank resolves anything; the unit resolver runs only inside that one call (once for
disagg2, once per bucket for HotSPa).
"""

import os
import subprocess
import sys
from collections import Counter

import pytest

from ..conftest import REPO, cli_overrides, read_metrics
from .test_hotspa import COMMON

pytestmark = pytest.mark.distributed

SITE = """
import os

import disttrain_core.launch.entry as entry
import disttrain_core.parallel.plan as plan
import disttrain_core.parallel.resolved as resolved

_LOG = os.environ["DISTTRAIN_COUNT_RESOLVES"]
# the first process to start is train.py; the fork server and the ranks inherit its pid here
_MAIN = int(os.environ.setdefault("DISTTRAIN_COUNT_MAIN", str(os.getpid())))
_inside = []


def _where():
    if os.getpid() != _MAIN:
        return "rank"
    return "launch" if _inside else "preflight"


def _counted(name, function):
    def call(*args, **kwargs):
        with open(_LOG, "a") as log:
            log.write(f"{name} {_where()} {os.getpid()}\\n")
        return function(*args, **kwargs)

    return call


def _launch(original):
    def launch(cfg):
        _inside.append(True)
        try:
            return original(cfg)
        finally:
            _inside.pop()

    return launch


resolved.resolve_run = _counted("resolve_run", resolved.resolve_run)
plan.units_of = _counted("units_of", plan.units_of)
entry.launch = _launch(entry.launch)
"""

HOTSPA = [
    *COMMON[:8],  # test_hotspa.py's small Llama on long-tailed packed text, three buckets
    "parallel=hotspa",
    "parallel.hotspa.strategies=[dp2,dp2,tp2]",
    "trainer.devices=2",
]


def _counts(shards, run_dir, tmp_path, *overrides) -> Counter:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    log = tmp_path / "resolves.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]),
        "DISTTRAIN_COUNT_RESOLVES": str(log),
    }
    args = cli_overrides(shards, run_dir) + ["trainer.max_steps=1", *overrides]
    done = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [1]  # it trained
    return Counter(" ".join(line.split()[:2]) for line in log.read_text().splitlines())


def test_a_disaggregated_launch_resolves_its_layout_once(shards, tmp_path):
    counts = _counts(shards, tmp_path / "run", tmp_path, "parallel=disagg2")
    assert counts["resolve_run launch"] == 1, counts
    assert counts["units_of launch"] == 1, counts  # inside that one call
    assert not any(key.endswith(" rank") for key in counts), counts  # the ranks read the launcher's
    # train.py's argument check validates the command line before Hydra runs the job: once more, outside launch()
    assert counts["resolve_run preflight"] == 1, counts


def test_a_hotspa_launch_resolves_every_bucket_in_one_call(shards, tmp_path):
    counts = _counts(shards, tmp_path / "run", tmp_path, *HOTSPA)
    assert counts["resolve_run launch"] == 1, counts
    assert counts["units_of launch"] == 3, counts  # one layout per bucket, all in that one call
    assert not any(key.endswith(" rank") for key in counts), counts
    assert counts["resolve_run preflight"] == 1, counts
