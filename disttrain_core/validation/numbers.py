"""Bounds of single settings: every count, size, ratio, timeout and enumerated choice of the schema.

One table row per setting: the dotted key, the test its value must pass and the advice the one-line error
gives. ``validate_config`` runs ``validate_model`` first and that runs :func:`check_bounds` before anything
else, so no later check (or the planner) divides by zero, loops over a negative count or compares against a
misspelled choice. Checks that relate several settings (divisibility, layouts, files) stay in ``settings``,
``layout`` and ``data``. Settings of an optional part (``model.encoder``, ``model.generator``,
``model.llm.rope_scaling``) are checked when that part is present. Settings with no bound of their own:
seeds of Python's ``random`` (``data.synthetic.seed``), booleans, free-form strings and paths.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from ..config import PROJECTOR_KINDS
from .common import ConfigError

LAYERS_MAX = 4096  # transformer blocks (Llama-3.1 405B has 126)
SEQ_MAX = 2**24  # tokens per sequence: 16.8M, past any model's context (the rotary tables are built at this length)
SEED_MAX = 2**32 - 1  # numpy (and Lightning's seed_everything) accept seeds in [0, 2**32 - 1]


PROJECTORS = ("encoder_projector", "audio_projector", "video_projector", "generator_projector")
PROJECTORS += ("audio_generator_projector",)


class Rule(NamedTuple):
    key: str  # dotted key, e.g. "optim.eps"
    test: Callable[[Any], bool]
    advice: str  # what to use instead, after "<key>=<value>: "


def _number(value: Any) -> bool:
    """An int or a finite float (huge ints are fine: they are compared, never converted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)


def at_least(key: str, low: int | float, advice: str | None = None) -> Rule:
    return Rule(key, lambda v: _number(v) and v >= low, advice or f"use {low} or more")


def positive(key: str, advice: str = "use a positive number") -> Rule:
    return Rule(key, lambda v: _number(v) and v > 0, advice)


def within(key: str, low: float, high: float, *, open_low: bool = False, open_high: bool = False) -> Rule:
    def test(v: Any) -> bool:
        return _number(v) and (v > low if open_low else v >= low) and (v < high if open_high else v <= high)

    interval = f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    return Rule(key, test, f"use a value in {interval}")


def one_of(key: str, choices: Iterable[Any], advice: str | None = None) -> Rule:
    allowed = tuple(choices)
    return Rule(key, lambda v: v in allowed, advice or f"allowed values are {', '.join(map(str, allowed))}")


def optional(rule: Rule, advice: str) -> Rule:
    """``rule``, or null."""
    return Rule(rule.key, lambda v: v is None or rule.test(v), advice)


def each(rule: Rule, advice: str, allow_empty: bool = False) -> Rule:
    """A list whose every entry passes ``rule`` (and that is not empty unless ``allow_empty``)."""
    return Rule(rule.key, lambda v: (allow_empty or len(v) > 0) and all(rule.test(x) for x in v), advice)


def _model_rules() -> list[Rule]:
    llm, vit, unet = "model.llm", "model.encoder", "model.generator"
    rules = [
        within("model.seq_len", 8, SEQ_MAX),
        at_least("model.gen_image_size", 1),
        at_least("model.latent_downsample", 1, "use 1 or more pixels per latent cell (SD's VAE: 8)"),
        at_least("model.gen_loss_weight", 0, "use 0 (no generation loss) or a positive weight"),
        at_least("model.nominal_images_per_sample", 0),
        at_least("model.reference_global_batch", 1),
        at_least("model.reference_micro_batch", 1),
        at_least("model.init_std", 0, "use 0 or a small positive standard deviation, e.g. 0.02"),
        *(at_least(f"{llm}.{n}", 1) for n in ("vocab_size", "dim", "n_heads", "n_kv_heads", "ffn_dim")),
        # a block count past any real model is a typo; the checks after these build the model on meta, block by block
        within(f"{llm}.n_layers", 1, LAYERS_MAX),
        positive(f"{llm}.norm_eps", "use a small positive number, e.g. 1e-5"),
        positive(f"{llm}.rope_theta", "use a positive base, e.g. 10000.0 or 500000.0"),
        one_of(f"{llm}.rope_scaling.rope_type", ("llama3",), "the supported rope_type is 'llama3'"),
        at_least(f"{llm}.rope_scaling.factor", 1, "use 1 or more (Llama-3.1: 8.0)"),
        positive(f"{llm}.rope_scaling.low_freq_factor", "use a positive number (Llama-3.1: 1.0)"),
        positive(f"{llm}.rope_scaling.high_freq_factor", "use a positive number (Llama-3.1: 4.0)"),
        at_least(f"{llm}.rope_scaling.original_max_position_embeddings", 1),
        *(at_least(f"{vit}.{n}", 1) for n in ("image_size", "patch_size", "channels", "dim")),
        within(f"{vit}.n_layers", 1, LAYERS_MAX),
        *(at_least(f"{vit}.{n}", 1) for n in ("n_heads", "mlp_dim")),
        at_least(f"{vit}.output_dim", 0, "use 0 (no output projection) or more"),
        positive(f"{vit}.norm_eps", "use a small positive number, e.g. 1e-5"),
        at_least(f"{unet}.in_channels", 1),
        each(at_least(f"{unet}.block_out_channels", 1), "give one positive channel count per level, e.g. [32,64]"),
        *(at_least(f"{unet}.{n}", 1) for n in ("layers_per_block", "head_dim", "cross_attention_dim")),
        each(
            at_least(f"{unet}.attention_heads", 1),
            "give one positive head count per level, or [] for channels // head_dim",
            allow_empty=True,
        ),
        at_least(f"{unet}.norm_groups", 1, "use 1 or more groups that divide every channel count, e.g. 8 or 32"),
        at_least(f"{unet}.num_train_timesteps", 1),
        within(f"{unet}.beta_start", 0, 1, open_low=True, open_high=True),
        within(f"{unet}.beta_end", 0, 1, open_low=True, open_high=True),
    ]
    for tower in ("audio_encoder", "video_encoder"):  # their divisibility checks follow (validation/modalities.py)
        rules += [at_least(f"model.{tower}.{n}", 1) for n in ("dim", "n_heads")]
    rules += [at_least(f"model.video_encoder.{n}", 1) for n in ("image_size", "patch_size")]
    for name in PROJECTORS:  # which may resample, and each kind's layer count: validation/projectors.py
        key = f"model.{name}"
        rules += [
            one_of(f"{key}.kind", PROJECTOR_KINDS),
            at_least(f"{key}.hidden_dim", 0, "use 0 (the output width; a resampler: 4 x the output width) or more"),
            within(f"{key}.n_layers", 1, LAYERS_MAX),
            within(f"{key}.num_queries", 1, SEQ_MAX),
            at_least(f"{key}.n_heads", 1),
        ]
    return rules


def _fault_tolerance_rules() -> list[Rule]:
    ft = "trainer.fault_tolerance"
    return [
        at_least(f"{ft}.replicas", 2, "use 2 replica groups or more"),
        optional(at_least(f"{ft}.min_replicas", 1), "use null (a majority) or a number of groups"),
        within(f"{ft}.replace_timeout_s", 1, 86400),
        at_least(f"{ft}.replace_delay_s", 0, "use 0 (at once) or more seconds"),
        at_least(f"{ft}.max_replacements", 0, "use 0 (never replace) or more"),
        positive(f"{ft}.timeout_s", "use a positive number of seconds, e.g. 30"),
        positive(f"{ft}.quorum_timeout_s", "use a positive number of seconds, e.g. 120"),
        within(f"{ft}.join_timeout_ms", 1, 600000),
        within(f"{ft}.heartbeat_timeout_ms", 100, 600000),
    ]


def _cluster_rules() -> list[Rule]:
    return [
        one_of("cluster.device", ("cpu", "cuda")),
        at_least("cluster.num_gpus", 1),
        at_least("cluster.gpus_per_node", 1),
        positive("cluster.memory_per_device_gb", "use a positive size"),
        optional(positive("cluster.peak_flops_bf16"), "use a positive FLOP/s value or null"),
        optional(positive("cluster.peak_flops_fp32"), "use a positive FLOP/s value or null"),
        positive("cluster.intra_node_bandwidth_gbps", "use a positive bandwidth in GB/s"),
        positive("cluster.inter_node_bandwidth_gbps", "use a positive bandwidth in GB/s"),
        at_least("cluster.latency_us", 0, "use 0 or more microseconds"),
        positive("cluster.memory_bandwidth_gbps", "use a positive bandwidth in GB/s"),
        within("cluster.compute_efficiency", 0, 1, open_low=True),
        at_least("cluster.runtime_overhead_gb", 0, "use 0 or more GB"),
        positive("cluster.host_bandwidth_gbps", "use a positive bandwidth in GB/s"),
        positive("cluster.host_adam_gparams", "use a positive rate in billions of parameters per second"),
        positive("cluster.host_memory_per_node_gb", "use a positive size"),
    ]


def _run_rules() -> list[Rule]:
    t, s = "trainer", "data.synthetic"
    return [
        # optimizer
        one_of("optim.name", ("adamw", "sgd"), "the available optimizers are 'adamw' and 'sgd'"),
        positive("optim.lr", "the learning rate must be positive and finite, e.g. optim.lr=3e-4"),
        within("optim.min_lr_ratio", 0, 1),
        at_least("optim.warmup_steps", 0),
        optional(at_least("optim.decay_steps", 1), "use null (decay over trainer.max_steps) or 1 or more steps"),
        at_least("optim.weight_decay", 0),
        positive("optim.eps", "use a small positive number, e.g. 1e-8"),
        at_least("optim.grad_clip", 0, "use 0 (off) or a positive norm"),
        within("optim.momentum", 0, 1, open_high=True),
        at_least("optim.micro_batch_size", 1),
        at_least("optim.global_batch_size", 1),
        # trainer
        one_of(f"{t}.accelerator", ("auto", "cpu", "cuda")),
        one_of(f"{t}.precision", ("auto", "32", "bf16-mixed"), "allowed values are auto, '32' and 'bf16-mixed'"),
        one_of(f"{t}.backend", ("auto", "gloo", "nccl")),
        at_least(f"{t}.devices", 1),
        at_least(f"{t}.num_nodes", 1),
        optional(at_least(f"{t}.min_nodes", 1), "use null (exactly trainer.num_nodes) or 1 to trainer.num_nodes"),
        at_least(f"{t}.max_steps", 1),
        optional(at_least(f"{t}.exit_after_step", 1), "use null or a step >= 1"),
        at_least(f"{t}.log_every_n_steps", 1),
        at_least(f"{t}.val_every_n_steps", 0, "use 0 (no validation) or a number of steps"),
        at_least(f"{t}.val_batches", 1, "evaluate at least 1 global batch"),
        within(f"{t}.seed", 0, SEED_MAX),
        at_least(f"{t}.threads_per_rank", 0, "use 0 (auto) or more"),
        at_least(f"{t}.dist_timeout_s", 1, "use a positive number of seconds, e.g. 300"),
        positive(f"{t}.stop_grace_s", "use a positive number of seconds, e.g. 600"),
        at_least(f"{t}.max_restarts", 0, "use 0 (no restarts) or more"),
        at_least(f"{t}.checkpoint.every_n_steps", 0, "use 0 (off) or more"),
        at_least(f"{t}.checkpoint.keep_last", 1, "keep at least 1"),
        within(f"{t}.straggler.factor", 1, 100),
        within(f"{t}.straggler.probability", 0, 1),
        each(at_least(f"{t}.straggler.ranks", 0), "give ranks >= 0, e.g. [1]", allow_empty=True),
        # data (data.* and data.producer.* are checked in settings.validate_data)
        at_least(f"{s}.num_shards", 1),
        at_least(f"{s}.samples_per_shard", 1),
        at_least(f"{s}.val_shards", 1),
        within(f"{s}.text_only_fraction", 0, 1),
        within(f"{s}.images_geometric_p", 0, 1, open_low=True),
        at_least(f"{s}.max_images", 1),
        within(f"{s}.video_fraction", 0, 1),
        within(f"{s}.audio_fraction", 0, 1),
        at_least(f"{s}.video_frames_max", 2, "a video has 2 frames or more"),
        at_least("data.video_frames", 1, "use 1 (a video's first frame) or more, e.g. 8"),
        # log-normal parameters: bounded so the drawn caption lengths and image sides stay finite and small
        within(f"{s}.caption_words_log_mean", 0, 7),
        within(f"{s}.caption_words_log_sigma", 0, 2),
        within(f"{s}.image_side_log_mean", 0, 10),
        within(f"{s}.image_side_log_sigma", 0, 2),
        at_least(f"{s}.image_side_max", 16, "use 16 pixels or more"),
        within(f"{s}.aspect_log_sigma", 0, 2),
        # schedule (the layout checks its agreement with the batch sizes)
        optional(at_least("schedule.microbatches", 1), "use null (derived from the batch sizes) or 1 or more"),
        at_least("schedule.vpp", 1),
        *_cluster_rules(),
        # planner
        one_of("planner.solver", ("algorithm1", "exhaustive")),
        one_of("planner.precision", ("auto", "32", "bf16-mixed"), "allowed values are auto, '32' and 'bf16-mixed'"),
        one_of("planner.cost", ("auto", "profiled", "analytic")),
        each(at_least("planner.tp_options", 1), "give one or more tensor-parallel sizes >= 1, e.g. [1,2,4,8]"),
        each(at_least("planner.vpp_options", 1), "give one or more virtual stage counts >= 1, e.g. [1]"),
        within("planner.dp_overlap", 0, 1),
        within("planner.memory_margin", 0, 1, open_low=True),
        at_least("planner.profile_repeats", 1),
    ]


def _sample_rules() -> list[Rule]:
    """trainer.sample_every_n_steps and what it generates (train/sampling.py), and the trackers' settings."""
    t = "trainer"
    return [
        at_least(f"{t}.sample_every_n_steps", 0, "use 0 (no samples) or a number of steps"),
        at_least(f"{t}.samples.max_new_tokens", 1),
        at_least(f"{t}.samples.temperature", 0, "use 0 (greedy) or a positive temperature"),
        within(f"{t}.samples.top_p", 0, 1, open_low=True),
        at_least(f"{t}.samples.steps", 1, "use at least 1 denoising step, e.g. 25"),
        one_of(f"{t}.samples.sampler", ("ddim", "ddpm")),
        within(f"{t}.samples.seed", 0, SEED_MAX),
        one_of("logger.wandb_mode", ("offline", "online")),
    ]


RULES: tuple[Rule, ...] = (*_model_rules(), *_run_rules(), *_fault_tolerance_rules(), *_sample_rules())


def _group(rules: Iterable[Rule]) -> list[tuple[tuple[str, ...], list[tuple[str, Rule]]]]:
    """Rules by parent node, so that each node is looked up once."""
    groups: dict[tuple[str, ...], list[tuple[str, Rule]]] = {}
    for rule in rules:
        *parent, leaf = rule.key.split(".")
        groups.setdefault(tuple(parent), []).append((leaf, rule))
    return list(groups.items())


_GROUPED = _group(RULES)


def show(value: Any) -> str:
    """A value as the error line writes it: strings quoted, lists as lists."""
    if isinstance(value, str):
        return repr(value)
    if value is not None and not isinstance(value, (int, float)) and hasattr(value, "__iter__"):
        return str(list(value))
    return str(value)


def _node(cfg: Any, path: tuple[str, ...]) -> Any:
    node = cfg
    for name in path:
        node = node.get(name) if hasattr(node, "get") else getattr(node, name, None)
        if node is None:  # an optional part that is not there (e.g. model.generator=null)
            return None
    return node


_ABSENT = object()


def _value(node: Any, leaf: str) -> Any:
    """``node.<leaf>``, resolved (``_ABSENT`` if there is no such field). Plain values are read from their
    node directly: attribute access costs ten times more, and this runs for every rule."""
    from omegaconf import Container

    if not isinstance(node, Container):
        return getattr(node, leaf, _ABSENT)
    child = node._get_node(leaf, validate_access=False, throw_on_missing_key=False)
    if child is None:
        return _ABSENT
    if isinstance(child, Container) or child._is_interpolation():
        return node[leaf]
    return child._value()


def check_bounds(cfg: Any) -> None:
    """Raise ConfigError for the first setting outside its bounds."""
    for parent, rules in _GROUPED:
        node = _node(cfg, parent)
        if node is None:
            continue
        for leaf, rule in rules:
            value = _value(node, leaf)
            if value is _ABSENT:  # a field another schema version does not have
                continue
            if not rule.test(value):
                raise ConfigError(f"{rule.key}={show(value)}: {rule.advice}")
    _check_pairs(cfg)


def _check_pairs(cfg: Any) -> None:
    """Bounds that are a pair of settings of one part."""
    scaling = _node(cfg, ("model", "llm", "rope_scaling"))
    if scaling is not None and not scaling.high_freq_factor > scaling.low_freq_factor:
        raise ConfigError(
            f"model.llm.rope_scaling.high_freq_factor={scaling.high_freq_factor} must be greater than "
            f"low_freq_factor={scaling.low_freq_factor} (Llama-3.1: 4.0 and 1.0)"
        )
    unet = _node(cfg, ("model", "generator"))
    if unet is not None and not unet.beta_start <= unet.beta_end:
        raise ConfigError(
            f"model.generator.beta_start={unet.beta_start} is above beta_end={unet.beta_end}; the noise schedule "
            "rises from beta_start to beta_end (SD: 0.00085 to 0.012)"
        )
