"""The closure: every composition the planner plans (tools/regime.py's grid, tools/bench_planner.py's instances) and
every GPU recipe trains is made of facts that a proven run of conf/proven_compositions.yaml trains in make test
(parallel/composition.py says what a fact is and why facts and not whole compositions). And the table cannot drift:
every row resolves to the composition it names and names a test that exists."""

from __future__ import annotations

import json
import sys

import pytest

from disttrain_core.config import REPO_ROOT
from disttrain_core.planner.proven import PROVEN_FILE, proven_facts, proven_runs, resolve_row

RUNS = proven_runs()


@pytest.fixture(scope="module")
def tool():
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    try:
        import compositions

        yield compositions
    finally:
        sys.path.remove(str(REPO_ROOT / "tools"))


@pytest.fixture(scope="module")
def table():
    compositions = [resolve_row(run) for run in RUNS]
    return compositions, proven_facts(RUNS, compositions)


def test_every_row_resolves_to_the_composition_it_names(table):
    compositions, _ = table
    for run, composition in zip(RUNS, compositions, strict=True):
        assert composition.key == run.composition, f"{PROVEN_FILE.name}: {run.test}"


def test_every_row_names_a_make_test_test_that_exists():
    for run in RUNS:
        path, _, name = run.test.partition("::")
        function, _, case = name.partition("[")
        text = (REPO_ROOT / path).read_text()
        assert f"def {function}(" in text, run.test
        if case and not path.endswith("test_compositions.py"):  # that file's cases are these rows
            assert case.rstrip("]") in text, run.test
        marked = f"@pytest.mark.slow\ndef {function}(" in text
        assert not marked, f"{run.test} is marked slow: a proven run must be in make test"


def test_every_planned_and_recipe_composition_is_proven(table, tool):
    _, proven = table
    found = tool.collect(tool.all_instances())
    unproven = [(key, item, proven.missing(item.composition)) for key, item in found.items()]
    unproven = [u for u in unproven if u[2]]
    report = {
        "compositions": len(found),
        "instances": sum(len(i.instances) for i in found.values()),
        "proven_runs": len(RUNS),
        "facts": len(proven.facts),
    }
    print(json.dumps(report))
    assert len(found) >= 30 and report["instances"] >= 150, report  # the grid really planned
    if unproven:
        key, item, missing = unproven[0]
        pytest.fail(
            f"{item.instances[0]} plans {key}: {missing[0]} is trained by no run of {PROVEN_FILE.name} "
            f"({len(unproven)} unproven composition(s) of {len(found)}); prove it (a row and its test) or take the "
            "option out of the planner's search"
        )


def test_a_composition_with_an_unproven_fact_is_named(table):
    """The check itself: a proven composition with context parallelism added to its generator unit (no run trains
    that) is reported by that unit's fact, the others still proven."""
    from dataclasses import replace

    compositions, proven = table
    base = next(c for c in compositions if any(p.name == "generator" for p in c.units))
    assert proven.missing(base) == []
    units = tuple(replace(p, dims=(*p.dims, "cp")) if p.name == "generator" else p for p in base.units)
    missing = proven.missing(replace(base, units=units))
    assert len(missing) == 1 and missing[0].startswith("unit: generator(") and ",cp|" in missing[0], missing


UNRUNNABLE = {
    # composition the runtime cannot run: (its overrides, the nearest runnable change its error names)
    "cp_in_the_generator_unit": (
        ["parallel=disagg4_pp2", "parallel.units.generator.cp=2"],
        ["parallel.units.generator.cp=1"],
    ),
    "ep_in_a_dense_model": (["parallel=dp", "trainer.devices=2", "parallel.ep=2"], ["parallel.ep=1"]),
    "hsdp_without_fsdp": (
        [
            "parallel=dp",
            "trainer.devices=4",
            "optim.micro_batch_size=2",
            "parallel.shard=zero1",
            "parallel.hsdp_replicas=2",
        ],
        ["parallel.shard=zero2"],
    ),
    "fsdp_under_zero_bubble": (
        ["parallel=pp2", "trainer.devices=4", "parallel.dp=2", "parallel.shard=zero3", "schedule=zb_h1"],
        ["schedule=1f1b"],
    ),
    "ddp_with_tp": (
        ["parallel=megatron_tp2", "model=llama_tiny", "schedule=none", "trainer.devices=2", "parallel.shard=none"],
        ["parallel.shard=zero1"],
    ),
    "chunked_tp_with_cp": (
        [
            "model=llama_tiny",
            "parallel.mode=megatron",
            "parallel.tp=2",
            "parallel.cp=2",
            "trainer.devices=4",
            "parallel.comm.tp_overlap=true",
        ],
        ["parallel.comm.tp_overlap=false"],
    ),
    "vpp_in_the_encoder_unit": (["parallel=disagg2", "parallel.units.encoder.vpp=2"], ["parallel.units.encoder.vpp=1"]),
    "a_colocated_encoder_sharded_apart": (
        [
            "parallel=disagg2",
            "parallel.units.encoder.colocate=true",
            "schedule=none",
            "parallel.units.llm.dp=2",
            "trainer.devices=2",
            "parallel.units.encoder.shard=zero3",
        ],
        ["parallel.units.llm.shard=zero3", "parallel.units.encoder.shard=zero1"],
    ),
}


@pytest.mark.parametrize("case", list(UNRUNNABLE))
def test_a_composition_the_runtime_cannot_run_fails_in_one_line_naming_the_nearest_it_can(case):
    """Before any process starts (validation): one line that names the nearest composition the runtime runs, and
    that composition validates."""
    from disttrain_core.config import compose, override_key, typed_config
    from disttrain_core.validation import ConfigError, validate_config

    bad, nearest = UNRUNNABLE[case]
    here = ["paths.output_dir=/nonexistent/unrunnable"]
    with pytest.raises(ConfigError) as error:
        validate_config(typed_config(compose([*bad, *here])))
    message = str(error.value)
    assert "\n" not in message and nearest[0] in message, message
    changed = {override_key(o) for o in nearest}
    fixed = [o for o in bad if override_key(o) not in changed] + nearest
    assert validate_config(typed_config(compose([*fixed, *here]))) is not None
