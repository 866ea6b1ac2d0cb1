"""Property-based fuzzing of config composition + validation (hypothesis).

Each example is a command line: config group choices (known and unknown), overrides of fields drawn from
every leaf of the schema with valid and invalid values (zeros, negatives, huge numbers, nan/inf, wrong
types, unknown choices, bad references, malformed overrides), sometimes a ``-m`` sweep. Every one is
composed and validated; the property: it is accepted, or it fails with a PreflightError whose message is
one line (a ConfigError from validation, a group or parse error, or a Hydra/OmegaConf composition error
converted by ``cli.describe_compose_error``) -- never another exception, never a hang (each example runs
under an alarm), never a launched process or generated data (all of them are patched to fail).

Speed: composing through Hydra takes ~0.2 s, too slow for thousands of examples. ``fast_check`` composes
once per set of group choices (cached) and applies the field overrides to a copy (unpickled: 3x faster
than deepcopy, same flags and schema types) with Hydra's own ``ConfigLoaderImpl._apply_overrides_to_config``,
the function ``compose`` runs after merging the defaults list, on the same struct-mode config, in the same
order: the result equals ``compose(argv)``. The few overrides compose handles earlier
(``real_compose_only``) take the real ``compose``. The composed config is validated directly (it already
carries the schema ``typed_config`` would merge again). ``test_fast_path_agrees_with_check_overrides``
checks the equivalence against the real ``cli.check_overrides``. FUZZ_EXAMPLES=<n> overrides the count.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import time
import typing
from collections import Counter
from contextlib import ExitStack, contextmanager
from unittest import mock

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from disttrain_core.config import CONFIG_GROUPS, Config, compose, group_options
from disttrain_core.launch import cli
from disttrain_core.parallel.recompute import POLICIES
from disttrain_core.planner.fit import check_state_fits, validate_run
from disttrain_core.validation import ConfigError
from disttrain_core.validation.numbers import RULES

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", 600))  # default suite (~15 s on 2 cores)
SLOW_EXAMPLES = 12000
EXAMPLE_TIMEOUT_S = 30  # one example taking longer is a hang
# Reproducible (derandomize), no deadline, no example database, and no explain phase (its tracing is slow).
SETTINGS = dict(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
)

# ------------------------------------------------------------------------------------------ the catalog
SKIPPED = ("paths.", "tags", "task_name", "optimized_metric")  # where runs write, free-form names


def _leaves(cls: type, prefix: str = "") -> dict[str, typing.Any]:
    """Dotted key -> annotated type of every leaf of the schema (optional sub-configs included)."""
    out: dict[str, typing.Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        inner = [a for a in typing.get_args(kind) if a is not type(None)]
        target = inner[0] if typing.get_origin(kind) is typing.Union and len(inner) == 1 else kind
        if dataclasses.is_dataclass(target):
            if target is not kind:  # Optional[SubConfig]: null, or {} for the defaults
                out[prefix + f.name] = "subconfig"
            out.update(_leaves(target, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = kind
    return out


LEAVES = {k: v for k, v in _leaves(Config).items() if not k.startswith(SKIPPED)}

INTS = ["0", "1", "2", "3", "4", "8", "16", "64", "-1", "-7", "1000000000", "9223372036854775808", "1" + "0" * 30]
FLOATS = ["0.0", "1e-08", "0.01", "0.5", "0.95", "1.0", "2.0", "300.0", "-1.0", "-1e-09", "1e+30", "inf", "-inf", "nan"]
WRONG = ["abc", "true", "null", "1.5", "[1]", "{a:1}", "''", "${oops}", "${optim.lr}"]
MALFORMED = ["optim.lr=", "trainer.devices=[", "=5", "trainer..devices=1", "+trainer.foo=1", "~trainer.devices"]
MALFORMED += ["trainer.max_stepz=5", "model.llm.dim=${model.nope}", "optim.lr=1e-3,-1", "data.path='a{b'"]
SHARD_PATHS = ["SHARDS", "'SHARDS/shard-{000000..000003}.tar'", "'SHARDS/shard-{000000..000005}.tar'"]
SHARD_PATHS += ["'SHARDS/*.tar'", "/nonexistent/shards", "''", "'SHARDS/shard-{0..99999999999}.tar'"]
SHARDS_MODES = ["null", "none", "zero1", "zero2", "zero3", "zero4"]
STRINGS = {
    "model.family": ["mllm", "llama", "gpt"],
    "model.latent_encoder": ["pixel", "bogus"],
    "model.encoder.activation": ["gelu", "quick_gelu", "relu"],
    "model.encoder_projector.kind": ["mlp", "resampler", "perceiver"],
    "model.generator_projector.kind": ["mlp", "resampler"],
    "model.llm.rope_scaling.rope_type": ["llama3", "linear"],
    "optim.name": ["adamw", "sgd"],
    "trainer.accelerator": ["auto", "cpu", "cuda", "tpu"],
    "trainer.precision": ["auto", "32", "bf16-mixed", "16"],
    "trainer.backend": ["auto", "gloo", "nccl", "mpi"],
    "trainer.sync_debug": ["off", "warn", "error", "loud"],
    "trainer.resume": ["none", "auto", "/no/such/run"],
    "trainer.deterministic": ["auto", "true", "false", "warn", "maybe", "3"],
    "data.tokenizer": ["byte", "/no/such/tokenizer.json", "bogus"],
    "data.path": SHARD_PATHS,
    "data.producer.address": ["null", "127.0.0.1:7070", "nohost", "host:99999"],
    "data.producer.listen": ["127.0.0.1:0", ":80", "x"],
    "data.producer.key": ["null", "hex:00", "file:/no/such"],
    "parallel.mode": ["ddp", "megatron", "manual", "auto", "bogus"],
    "parallel.modality_stages": ["separate", "folded", "mixed"],
    "parallel.shard": SHARDS_MODES,
    "parallel.comm.collectives": ["auto", "ring", "native", "mpi"],
    "parallel.comm.wire_dtype": ["auto", "fp32", "bf16", "fp8"],
    "schedule.name": [
        "none",
        "gpipe",
        "1f1b",
        "interleaved_1f1b",
        "breadth_first",
        "zb_h1",
        "zb_h2",
        "zbv",
        "dualpipev",
        "pipedream",
    ],
    "schedule.csv": ["null", "/no/such.csv"],
    "planner.solver": ["algorithm1", "exhaustive", "greedy"],
    "planner.precision": ["auto", "32", "bf16-mixed", "fp8"],
    "planner.cost": ["auto", "profiled", "analytic", "guess"],
    "planner.recompute": ["auto", *POLICIES, "selective"],
    "planner.shard": ["auto", "zero1", "zero2", "zero3", "none"],
    "planner.profile_cache": ["/tmp/disttrain-fuzz-profiles"],
    "cluster.device": ["cpu", "cuda", "tpu"],
    "model.init_from": ["null", "/no/such/weights"],
    "model.latent_encoder_path": ["null", "/no/such/vae"],
}
for _unit in ("parallel", "parallel.units.encoder", "parallel.units.llm", "parallel.units.generator"):
    STRINGS[f"{_unit}.recompute"] = [*POLICIES, "sometimes"]
    if _unit != "parallel":
        STRINGS[f"{_unit}.shard"] = SHARDS_MODES[1:]
LISTS = {
    "optim.betas": ["[0.9,0.95]", "[0.9]", "[0.9,1.0]", "[-0.1,0.5]", "[]", "[a]"],
    "planner.tp_options": ["[1,2,4,8]", "[1]", "[]", "[0,2]", "[-1]"],
    "planner.vpp_options": ["[1]", "[1,2]", "[]", "[0]"],
    "model.generator.block_out_channels": ["[32,64]", "[16,32,32,32]", "[]", "[0,64]", "[32]", "[-8,16]"],
    "model.generator.cross_attention_blocks": ["[true,false]", "[true]", "[]"],
    "model.generator.attention_heads": ["[]", "[2,4]", "[0,4]", "[3,5]"],
    "parallel.comm.interleave_modes": ["[]", "[overlap]", "[overlap,fast]"],
}


def values_for(key: str) -> list[str]:
    """Override values of the key's type (valid and invalid ones); ``WRONG`` holds the wrong types."""
    kind = LEAVES[key]
    if key in STRINGS:
        good = STRINGS[key]
    elif key in LISTS:
        good = LISTS[key]
    elif kind == "subconfig":
        good = ["null", "{}"]
    elif kind is bool:
        good = ["true", "false"]
    elif kind is int or kind == typing.Optional[int]:
        good = INTS
    elif kind is float or kind == typing.Optional[float]:
        good = FLOATS
    else:
        good = ["bogus", "''"]
    if typing.get_origin(kind) is typing.Union:
        good = [*good, "null"]
    return good


GROUP_CHOICES: list[list[str]] = [[] for _ in range(30)]  # no group override in about half the examples
GROUP_CHOICES += [[f"{g}={o}"] for g in ("model", "parallel", "schedule", "data", "trainer") for o in group_options(g)]
GROUP_CHOICES += [[f"{g}={o}"] for g in ("cluster", "logger", "recipe", "hparams_search") for o in group_options(g)]
GROUP_CHOICES += [["model=nope"], ["parallel=bogus"], ["recipe=nope"], ["schedule=pipedream"]]
GROUP_CHOICES += [["model=llama_tiny", "parallel=pp2"], ["parallel=pp2", "schedule=1f1b"]]
GROUP_CHOICES += [["model=mllm9b", "parallel=auto"], ["parallel=disagg4_pp2", "schedule=zb_h1"]]
GROUP_CHOICES += [["parallel=pp4", "schedule=interleaved_1f1b"]]
KEYS = sorted(LEAVES)


@st.composite
def command_lines(draw) -> list[str]:
    """A command line after the base overrides (the test shards, CPU, a run directory)."""
    argv = list(draw(st.sampled_from(GROUP_CHOICES)))
    # hypothesis favours the simplest value (0, the first entry): the rare cases are the last entry
    multirun = draw(st.sampled_from(range(20))) == 19
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=4, unique=True)):
        values = st.sampled_from(values_for(key) * 5 + WRONG)  # about 1 in 6 (or fewer): a wrong type
        value = draw(values)
        if multirun and draw(st.booleans()):
            value += "," + draw(values)
        argv.append(f"{key}={value}")
    if draw(st.sampled_from(range(25))) == 24:
        argv.append(draw(st.sampled_from(MALFORMED)))
    return (["-m"] if multirun else []) + argv


# ------------------------------------------------------------------------------------ fast composition
_composed: dict[tuple[str, ...], typing.Any] = {}  # group choices + base -> (pickled config, config) or error


def _compose_cached(groups: list[str], base: list[str], fresh: bool):
    """The composed config of these group choices; ``fresh``: a copy the caller may change (validation only
    reads, so without field overrides the cached one serves)."""
    key = tuple(groups + base)
    if key not in _composed:
        try:
            cfg = compose(groups + base)
            _composed[key] = (pickle.dumps(cfg), cfg)
        except (HydraException, OmegaConfBaseException) as error:
            _composed[key] = error
    found = _composed[key]
    if isinstance(found, Exception):
        raise found
    return pickle.loads(found[0]) if fresh else found[1]  # unpickling: 3x faster than deepcopy, same flags


def known_compose_issue(error: BaseException) -> bool:
    """KNOWN ISSUE (in composition, outside the validation package; reported): a value for a part that is
    null or not a sub-config -- ``model.llm.rope_scaling.factor=2`` or ``model.llm.rope_scaling={factor:2.0}``
    while rope_scaling is null, ``model.encoder.dim=8`` with ``model=llama_tiny``, ``model.generator=${x}
    model.generator.head_dim=8`` -- fails inside OmegaConf with an AssertionError ("Unexpected type for
    root: NoneType") or an AttributeError ("'NoneType' object has no attribute 'get'"), which
    check_overrides turns into that one line: one line, but it names no key."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    inside_omegaconf = bool(frames) and "/omegaconf/" in frames[-1].filename
    return inside_omegaconf and (
        (isinstance(error, AssertionError) and "Unexpected type for root: " in str(error))
        or (isinstance(error, AttributeError) and "'NoneType' object has no attribute 'get'" in str(error))
    )


def real_compose_only(override) -> bool:
    """A sweep (refused without -m), a ``@package`` or an added / deleted group: handled by ``compose``
    before the field overrides are applied."""
    group = override.key_or_group in CONFIG_GROUPS
    added_or_deleted = override.is_add() or override.is_delete() or override.is_force_add()
    return override.is_sweep_override() or override.package is not None or (group and added_or_deleted)


def fast_check(base: list[str], example: list[str], fits: bool = False):
    """``cli.check_overrides(base + example)`` (see the module docstring). Returns the last composed config;
    raises PreflightError. ``fits``: also the state-fit check (it builds each model on the meta device, too
    slow for thousands of examples; the agreement test below runs it)."""
    argv = base + example
    cfg = None
    for overrides in cli._variants(argv, "-m" in argv):
        # variants change the example's overrides only (the base's come back as Hydra writes them: False)
        assert [o.split("=")[0] for o in overrides[: len(base)]] == [o.split("=")[0] for o in base]
        parsed = OverridesParser.create().parse_overrides(overrides[len(base) :])  # base: plain fields
        try:
            if not any(real_compose_only(o) for o in parsed):
                groups = [o.input_line for o in parsed if o.key_or_group in CONFIG_GROUPS]
                fields = [o for o in parsed if o.key_or_group not in CONFIG_GROUPS]
                cfg = _compose_cached(groups, base, fresh=bool(fields))
                ConfigLoaderImpl._apply_overrides_to_config(fields, cfg)
            else:
                cfg = compose(overrides)
        except (HydraException, OmegaConfBaseException) as error:  # anything else fails the test
            raise cli.PreflightError(cli.describe_compose_error(error, overrides)) from error
        except (AssertionError, AttributeError) as error:
            if not known_compose_issue(error):
                raise
            raise cli.PreflightError(cli.describe_compose_error(error, overrides)) from error
        try:
            validate_run(cfg)
            if fits:
                check_state_fits(cfg)  # as cli.check_overrides: a model whose state cannot fit is refused
        except ConfigError as error:
            refused = cli.PreflightError(str(error))
            refused.cfg = cfg  # type: ignore[attr-defined]  for the test's look at the refused value
            raise refused from error
    return cfg


# ---------------------------------------------------------------------------------------- guard rails
@contextmanager
def nothing_launches():
    """Every way to start a process or to generate data fails the test."""
    from disttrain_core.launch import entry as launch

    starters = ("launch", "prepare_data", "start_ranks", "start_producer", "run_worker", "spawn_local_processes")
    targets = [f"disttrain_core.launch.entry.{name}" for name in starters if hasattr(launch, name)]
    targets += [
        "disttrain_core.data.synthetic.generate_shards",
        "subprocess.Popen",
        "multiprocessing.process.BaseProcess.start",
        "torch.multiprocessing.start_processes",
    ]
    with ExitStack() as stack:
        for target in targets:
            stack.enter_context(mock.patch(target, side_effect=AssertionError(f"the fuzz test called {target}")))
        yield


@contextmanager
def alarm(seconds: float):
    """A TimeoutError after ``seconds``: an example that hangs fails instead of stalling the suite."""

    def hang(signum, frame):
        raise TimeoutError(f"one example took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def memory_cap(extra_bytes: int = 4 << 30):
    """At most ``extra_bytes`` more address space: an example that would exhaust the machine's memory (a
    list per pipeline stage of parallel.pp=10**18, say) fails with a MemoryError instead."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as statm:
        used = int(statm.read().split()[0]) * resource.getpagesize()
    cap = used + extra_bytes if hard == resource.RLIM_INFINITY else min(hard, used + extra_bytes)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


RULE_KEYS = {rule.key: rule for rule in RULES}


def check_example(base: list[str], example: list[str], shards, counts: Counter) -> None:
    example = [a.replace("SHARDS", str(shards)) for a in example]
    counts["examples"] += 1
    counts["multirun"] += "-m" in example
    try:
        with alarm(EXAMPLE_TIMEOUT_S):
            cfg = fast_check(base, example)
    except cli.PreflightError as error:
        message = str(error)
        assert message and "\n" not in message, (example, message)
        kind = type(error.__cause__).__name__ if error.__cause__ is not None else "PreflightError"
        counts[f"refused: {kind}"] += 1
        key, _, text = example[0].partition("=") if len(example) == 1 else ("", "", "")
        if key in RULE_KEYS and "${" not in text and text not in WRONG and isinstance(error.__cause__, ConfigError):
            # a single setting outside its bounds, on a valid base: the error names it and its value
            rule = RULE_KEYS[key]
            if OmegaConf.select(error.cfg, key.rsplit(".", 1)[0], default=None) is not None:
                value = OmegaConf.select(error.cfg, key)
                if not rule.test(value):
                    counts["refused: named"] += 1
                    assert message.startswith(f"{key}="), (example, message)
        return
    counts["accepted"] += 1
    fields = [a for a in example if "=" in a and a.split("=", 1)[0] in RULE_KEYS]
    for text in fields:  # an accepted value passed its rule
        rule = RULE_KEYS[text.split("=", 1)[0]]
        value = OmegaConf.select(cfg, rule.key, default=None)
        parent = rule.key.rsplit(".", 1)[0]
        if OmegaConf.select(cfg, parent, default=None) is not None:
            assert rule.test(value), (example, rule.key, value)


def base_for(shards) -> list[str]:
    """The test shards and a run directory that must never appear (the same for every test of this file, so
    they share the composed configs). Everything else at its default (CPU on this machine,
    generate_if_missing=true): short, because every example parses it again."""
    return [f"data.path={shards}", f"paths.output_dir={run_dir(shards)}"]


def run_dir(shards):
    return shards.parent / "fuzz-run-never-created"


def run_fuzz(shards, examples: int) -> Counter:
    base = base_for(shards)
    counts: Counter = Counter()

    @settings(max_examples=examples, **SETTINGS)
    @given(command_lines())
    def one(example):
        check_example(base, example, shards, counts)

    before = sorted(p.name for p in shards.iterdir())
    with nothing_launches(), memory_cap():
        one()
    assert sorted(p.name for p in shards.iterdir()) == before
    assert not run_dir(shards).exists()
    return counts


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("examples", [EXAMPLES, pytest.param(SLOW_EXAMPLES, marks=pytest.mark.slow)])
def test_every_override_set_is_accepted_or_refused_in_one_line(examples, shards, clean_env):
    started = time.perf_counter()
    counts = run_fuzz(shards, examples)
    outcomes = ", ".join(f"{k} {v}" for k, v in counts.items())
    print(f"\nfuzz: {counts['examples']} examples in {time.perf_counter() - started:.1f} s: {outcomes}")
    refused = counts["examples"] - counts["accepted"]
    assert counts["examples"] >= examples
    assert counts["accepted"] >= examples // 10 and refused >= examples // 2, counts  # a mix of both


def test_fast_path_agrees_with_check_overrides(shards, clean_env):
    """The cached composition gives the same verdict and message as the real preflight."""
    base = base_for(shards)
    compared: Counter = Counter()

    @settings(max_examples=25, **SETTINGS)
    @given(command_lines())
    def same(example):
        example = [a.replace("SHARDS", str(shards)) for a in example]
        verdicts = []
        for check in (lambda: fast_check(base, example, fits=True), lambda: cli.check_overrides(base + example)):
            try:
                check()
                verdicts.append(None)
            except cli.PreflightError as error:
                verdicts.append(str(error))
        assert verdicts[0] == verdicts[1], example
        compared["accepted" if verdicts[0] is None else "refused"] += 1

    with nothing_launches(), memory_cap():
        same()
    assert compared["accepted"] and compared["refused"], compared


def test_the_catalog_covers_every_bounded_setting():
    """Every row of the bounds table is a field of the schema, and the fuzzer draws values for it."""
    for rule in RULES:
        assert rule.key in LEAVES, rule.key
        assert values_for(rule.key)
    assert set(STRINGS) | set(LISTS) <= set(LEAVES), (set(STRINGS) | set(LISTS)) - set(LEAVES)
    assert all(group in CONFIG_GROUPS for choice in GROUP_CHOICES for group in (c.split("=")[0] for c in choice))
