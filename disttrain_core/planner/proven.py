"""The proven compositions (conf/proven_compositions.yaml): the runs ``make test`` trains and checks, and the facts
(parallel/composition.py) they prove.

Each row names a test, the overrides it trains (``reference``: the model and batch, shared with its one-process
reference; ``layout``: what makes the run parallel) and the composition those overrides resolve to. A row's facts
are its composition's; a composition is proven when every one of its facts is some row's. tests/unit/
test_compositions.py resolves every row (the committed composition must be what its overrides give, so the table
cannot drift from the tests) and checks the planner's plans against the union of the rows' facts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import CONF_DIR
from ..parallel.composition import Composition

PROVEN_FILE = CONF_DIR / "proven_compositions.yaml"
# What every row trains besides its overrides: the parity tests' fp32 (tests/distributed/test_units.py STEPS)
FP32 = ("trainer.precision=32",)


@dataclass(frozen=True)
class ProvenRun:
    test: str  # path::name[id] of the make-test test that trains it
    reference: tuple[str, ...]  # model and batch overrides (the one-process reference's)
    layout: tuple[str, ...]  # the parallel overrides
    composition: str  # the key its overrides resolve to
    check: str  # parity (one process, 1e-4), or what else the test compares, and how closely
    data: str = "shards"  # the test fixture of its data (tests/conftest.py, tests/distributed/conftest.py)

    @property
    def overrides(self) -> list[str]:
        """What the run trains (fp32 unless its layout names a precision)."""
        named = any(o.startswith("trainer.precision=") for o in self.layout)
        return [*self.reference, *self.layout, *(() if named else FP32)]

    @property
    def test_id(self) -> str:
        """The parametrization id of a tests/distributed/test_compositions.py row."""
        return self.test.rsplit("[", 1)[-1].rstrip("]")


def proven_runs(path: Path = PROVEN_FILE) -> list[ProvenRun]:
    import yaml

    rows = yaml.safe_load(path.read_text())["runs"]
    out = [
        ProvenRun(
            r["test"],
            tuple(r.get("reference", ())),
            tuple(r.get("layout", ())),
            r.get("composition", ""),
            r["check"],
            r.get("data", "shards"),
        )
        for r in rows
    ]
    tests = [run.test for run in out]
    duplicate = next((t for t in tests if tests.count(t) > 1), None)
    if duplicate:
        raise ValueError(f"{path.name}: {duplicate} is listed twice")
    return out


def resolve_row(run: ProvenRun) -> Composition:
    """The composition a row's overrides train (composed and resolved as the launch does, no process started)."""
    from ..config import compose, typed_config
    from ..parallel.composition import composition_of_config

    # paths.output_dir: Hydra's, which composing outside a run lacks; resolving writes nothing
    cfg = compose([*run.overrides, "paths.output_dir=/nonexistent/proven"])
    return composition_of_config(typed_config(cfg))


@dataclass(frozen=True)
class ProvenFacts:
    """fact -> the tests that train it."""

    facts: dict[str, tuple[str, ...]]

    def missing(self, composition: Composition) -> list[str]:
        """The facts of ``composition`` no proven run trains (empty: proven)."""
        return [fact for fact in composition.facts() if fact not in self.facts]


def proven_facts(runs: list[ProvenRun], compositions: list[Composition]) -> ProvenFacts:
    facts: dict[str, tuple[str, ...]] = {}
    for run, composition in zip(runs, compositions, strict=True):
        for fact in composition.facts():
            if run.check.startswith("bf16") and not fact.startswith("precision:"):
                continue  # a precision row's looser bound proves its precision, not its layout
            facts[fact] = (*facts.get(fact, ()), run.test)
    return ProvenFacts(facts)
