"""Command-line front door: catch configuration mistakes before Hydra starts
jobs or any process is launched, and report each as one actionable line.

``preflight(argv)`` checks the group choices, composes the config for every
value of every sweep (one variant per value, the other overrides at their
first value) and runs the semantic validation on each. It exits with status 2
and a single ``error: ...`` line on stderr at the first problem.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from ..config import CONFIG_GROUPS, MODEL_MODULE_GROUPS, compose, group_options, override_key
from ..validation import ConfigError

# Hydra flags that do not train (help, config printing, completion): no preflight.
PASSTHROUGH_FLAGS = {
    "--help",
    "-h",
    "--hydra-help",
    "--cfg",
    "-c",
    "--info",
    "-i",
    "--shell-completion",
    "-sc",
    "--version",
    "--resolve",
    "--package",
    "-p",
    "--experimental-rerun",
}
OPTIONAL_PLUGINS = {"optuna": "pip install hydra-optuna-sweeper==1.2.0 (it is in requirements.txt)"}


class PreflightError(Exception):
    pass


def one_line(error: BaseException) -> str:
    """The informative lines of an exception chain, joined into one line."""
    noise = ("full_key", "object_type", "reference_type", "Set the environment variable", "To append to your config")
    lines: list[str] = []
    current: BaseException | None = error
    while current is not None:
        for raw in str(current).splitlines():
            line = raw.strip()
            if line and not raw.startswith((" ", "\t")) and not line.startswith(noise) and line not in lines:
                lines.append(line)
        current = current.__cause__ or current.__context__
    return "; ".join(lines) or type(error).__name__


def _full_key(error: BaseException) -> str | None:
    current: BaseException | None = error
    while current is not None:
        key = getattr(current, "full_key", None)
        if key:
            return str(key)
        current = current.__cause__ or current.__context__
    return None


def describe_compose_error(error: BaseException, overrides: list[str]) -> str:
    text = one_line(error)
    key = _full_key(error)
    override = next((o for o in overrides if key and override_key(o) == key), None)
    where = override or key or "config"
    if "NoneType" in text and ("Unexpected type for root" in text or "has no attribute" in text):
        # OmegaConf cannot merge into an optional block whose value is null (omry/omegaconf#1035)
        keys = [override_key(o) for o in overrides if "=" in o]
        dotted = [k for k in keys if k.count(".") >= 2 and not k.startswith("hydra.")]
        target = key or (dotted[0] if len(dotted) == 1 else "one of " + ", ".join(dotted) if dotted else "a key")
        return (
            f"{target} is (or is inside) a block that is null in this config, and a null block cannot be "
            "filled from the command line (an OmegaConf limitation); set the whole block in a config file "
            "(e.g. a copy of the model's yaml in conf/model/) or choose a config where it is set"
        )
    if "not in" in text and key:
        parent, _, leaf = key.rpartition(".")
        return (
            f"{where}: {leaf!r} is not a key of {parent or 'the config'}; check the spelling "
            f"(`python train.py --cfg job` prints every key)"
        )
    if "could not be converted" in text.lower() or "is not a valid" in text:
        return f"{where}: {text}"
    for plugin, install in OPTIONAL_PLUGINS.items():
        if plugin in text and ("Could not load" in text or "not found" in text.lower()):
            return f"{text}; this needs an optional plugin: {install}"
    return f"{where}: {text}" if override else text


def _check_group_choice(group: str, value: str) -> None:
    options = group_options(group)
    if group in MODEL_MODULE_GROUPS and value in ("null", "None"):
        raise PreflightError(f"{group}={value}: drop a module with ~{group}, or choose one of: {', '.join(options)}")
    if value in options or value in ("null", "None") or value.startswith("["):  # a list: its elements are checked
        return
    if group == "hparams_search" or group == "recipe":
        kind = "recipe (recipes/*.yaml)" if group == "recipe" else "hparams_search preset"
    else:
        kind = f"{group} option (conf/{group}/*.yaml)"
    raise PreflightError(f"{group}={value} is not a known {kind}; choose one of: {', '.join(options)}")


def _variants(argv: list[str], multirun: bool) -> list[list[str]]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [a for a in argv if not a.startswith("-")]
    parser = OverridesParser.create()
    for text in overrides:  # name the override Hydra cannot read, and the usual cause
        try:
            parser.parse_overrides([text])
        except Exception as error:
            key, _, value = text.partition("=")
            if "{" in value and not value.startswith(("'", '"', "{")):
                raise PreflightError(
                    f"{text}: braces must be quoted for Hydra, and the quotes protected from the shell: "
                    f"\"{key}='{value}'\""
                ) from error
            raise PreflightError(f"cannot parse {text!r}: {one_line(error).split('; See https')[0]}") from error
    parsed = parser.parse_overrides(overrides)
    choices: list[list[str]] = []
    for text, override in zip(overrides, parsed, strict=True):
        key = override.key_or_group
        if multirun and override.is_sweep_override() and "glob(" not in text:
            values = list(override.sweep_string_iterator())
        else:
            values = [override.get_value_element_as_str()] if not override.is_sweep_override() else [None]
        if key in CONFIG_GROUPS and override.package is None and not override.is_delete():
            for value in values:
                if value is not None:
                    _check_group_choice(key, value)
            if not override.is_sweep_override() and isinstance(override.value(), list):  # logger=[a,b]: each
                for value in override.value():
                    _check_group_choice(key, str(value))
        prefix = text.split("=", 1)[0]
        choices.append([text] if values == [None] else [f"{prefix}={v}" for v in values])
    base = [options[0] for options in choices]
    variants = [base]
    for index, options in enumerate(choices):
        for option in options[1:]:
            variants.append(base[:index] + [option] + base[index + 1 :])
    return variants


def check_overrides(argv: list[str], on_composed: Callable | None = None) -> None:
    """Raise PreflightError describing the first configuration problem in ``argv``. ``on_composed(cfg)``:
    called with each variant's typed config before it is validated."""
    from ..base.startup import uncollected_imports

    with uncollected_imports():  # torch and the planner: most of train.py's start-up (base/startup.py)
        from ..config import typed_config
        from ..planner.fit import check_state_fits, validate_run
        from ..validation.common import check_references

    multirun = "-m" in argv or "--multirun" in argv
    for overrides in _variants(argv, multirun):
        try:
            composed = compose(overrides)
        except Exception as error:
            raise PreflightError(describe_compose_error(error, overrides)) from error
        try:
            check_references(composed)  # before the schema merge, which would raise a bare OmegaConf error
            cfg = typed_config(composed)
            if on_composed is not None:
                on_composed(cfg)
            validate_run(cfg)
            check_state_fits(cfg)
        except ConfigError as error:
            raise PreflightError(str(error)) from error


def check_submitter(argv: list[str]) -> None:
    """``-m ... hydra/launcher=<SLURM preset>`` submits every job with sbatch: it must be on PATH here, and
    SLURM must accept the job's sbatch settings (``sbatch --test-only`` on the first point's script: a partition,
    account or QOS it rejects is its own message, before anything is submitted)."""
    import shutil

    from ..validation.cluster_fit import scheduler_launcher

    launcher = scheduler_launcher(argv)
    if launcher is None:
        return
    if shutil.which("sbatch") is None:
        raise PreflightError(
            f"hydra/launcher={launcher} submits each job with sbatch, which is not on PATH here: run this on a "
            "SLURM login node (or load its environment), or leave out hydra/launcher to train on this machine"
        )
    from .cluster import sbatch_test_only

    refused = sbatch_test_only(_variants(argv, True)[0])
    if refused:
        raise PreflightError(
            f"SLURM refuses the job of hydra/launcher={launcher}: {refused} (sbatch --test-only; its settings are "
            "hydra.launcher.* overrides: partition, account, qos, cpus_per_task, timeout_min)"
        )


def preflight(argv: list[str]) -> None:
    if any(arg.split("=", 1)[0] in PASSTHROUGH_FLAGS for arg in argv):
        return
    from .launchers import warm_up

    try:
        check_submitter(argv)
        # the ranks' fork server starts importing while the config is validated (launchers.warm_up)
        check_overrides(argv, on_composed=warm_up)
    except PreflightError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def exit_now(code) -> None:
    """End train.py without the interpreter's teardown: with torch, Fabric and the models imported it
    takes 1.4 s (more after a run in this process), every time. By here the job is over: the ranks,
    the producer and checkpoint writers have ended and been joined, files are closed; logging and the
    standard streams are flushed below. ``code``: a SystemExit code (None, a status, or a message)."""
    import logging

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def split_tool_args(argv: list[str], options: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Separate a tool's own ``name=value`` options from Hydra overrides."""
    values = dict(options)
    overrides = []
    for arg in argv:
        name, sep, value = arg.partition("=")
        if sep and name in options:
            values[name] = value
        else:
            overrides.append(arg)
    return values, overrides


def tool_options(argv: list[str], options: dict[str, str]) -> dict[str, str]:
    """A tool's ``name=value`` options for a tool that takes nothing else; anything else is a ConfigError
    (``tool_main`` prints it as one ``error:`` line)."""
    values, rest = split_tool_args(argv, options)
    if rest:
        raise ConfigError(f"unknown option(s) {' '.join(rest)}: use {', '.join(f'{k}=' for k in options)}")
    return values


def tool_main(main: Callable[[list[str]], int], argv: list[str]) -> int:
    """Run a tool's ``main``; configuration errors become one ``error:`` line and status 2."""
    try:
        return main(argv)
    except BrokenPipeError:  # the output went to a pipe that closed early (``| head``): nothing to report
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  Python flushes stdout again at exit
        return 0
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
    except PreflightError as error:
        print(f"error: {error}", file=sys.stderr)
    except Exception as error:
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if not isinstance(error, (HydraException, OmegaConfBaseException)):
            raise
        print(f"error: {describe_compose_error(error, argv)}", file=sys.stderr)
    return 2
