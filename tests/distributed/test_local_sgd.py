"""Local SGD (parallel=local_sgd) against synchronous data parallelism and against DiLoCo's update rule
written out here, in fp32 on 4 processes (2 workers x 2 processes: DDP inside a worker, syncs across)."""

import copy

import pytest
import torch

from disttrain_core.train.checkpoint import latest_checkpoint, read_tensors

from ..conftest import cli_overrides, read_metrics, run_train

pytestmark = pytest.mark.distributed

STEPS = 6
COMMON = [
    "model=llama_tiny",
    "model.seq_len=16",  # every caption below is longer: each sample has the same number of loss tokens
    f"trainer.max_steps={STEPS}",
    "trainer.precision=32",
    "trainer.devices=4",
    "optim.global_batch_size=16",
    "optim.micro_batch_size=2",
    "optim.warmup_steps=2",
    "data.shuffle_shards=false",
]
MESH = ["parallel=local_sgd", "parallel.local_sgd.shard_group=2"]


@pytest.fixture(scope="module")
def long_text(tmp_path_factory):
    """4 shards of text-only samples whose captions all exceed 16 tokens (equal loss tokens per sample)."""
    from disttrain_core.config import SyntheticDataConfig
    from disttrain_core.data.synthetic import generate_shards

    out = tmp_path_factory.mktemp("text") / "shards"
    config = SyntheticDataConfig(
        num_shards=4,
        samples_per_shard=32,
        text_only_fraction=1.0,
        caption_words_log_mean=3.5,
        caption_words_log_sigma=0.05,
    )
    generate_shards(config, out, processes=1)
    return out


def _train(shards, run_dir, *extra):
    result = run_train(cli_overrides(shards, run_dir) + COMMON + list(extra))
    assert result.returncode == 0, result.stderr[-3000:]
    return [m["loss"] for m in read_metrics(run_dir)], read_tensors(latest_checkpoint(run_dir / "checkpoints"))


def _close(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# The identities with synchronous DP also run on every data source on 2 processes in make test
# (test_local_sgd_sources.py, test_loss_scale.py); on this 2 x 2 mesh in make test-slow.
@pytest.mark.slow
def test_a_warmup_over_the_whole_run_is_synchronous_data_parallelism(long_text, tmp_path):
    dp_losses, dp_params = _train(long_text, tmp_path / "dp", "parallel=dp")
    ls_losses, ls_params = _train(long_text, tmp_path / "ls", *MESH, f"parallel.local_sgd.warmup_steps={STEPS}")
    assert max(abs(a - b) for a, b in zip(dp_losses, ls_losses, strict=True)) < 1e-5
    assert _close(dp_params, ls_params) < 1e-5
    assert dp_losses[-1] < dp_losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["diloco", "post_local_sgd"])
def test_sgd_synced_every_step_with_outer_lr_one_is_synchronous_sgd(long_text, tmp_path, method):
    """optim=sgd, outer lr 1, no outer momentum, sync_every=1: the average of the workers' SGD steps is the SGD
    step on the averaged gradient (equal tokens per worker: each normalizes by its own)."""
    sgd = ["optim=sgd", "optim.lr=0.1", "optim.grad_clip=0", "optim.warmup_steps=2"]
    dp_losses, dp_params = _train(long_text, tmp_path / "dp", "parallel=dp", *sgd)
    outer = ["parallel.local_sgd.outer_lr=1", "parallel.local_sgd.outer_momentum=0"]
    ls_losses, ls_params = _train(
        long_text,
        tmp_path / method,
        *MESH,
        *sgd,
        *outer,
        f"parallel.local_sgd.method={method}",
        "parallel.local_sgd.warmup_steps=0",
        "parallel.local_sgd.sync_every=1",
    )
    # the logged loss is worker 0's (its half of the batch): compare the parameters, the same in every worker
    # after a sync
    assert _close(dp_params, ls_params) < 1e-5
    assert dp_losses[-1] < dp_losses[0] and len(ls_losses) == STEPS


def _reference_diloco(shards, warmup: int, every: int, outer_lr: float, momentum: float):
    """DiLoCo written from its update rule (Douillard et al. 2023, Algorithm 1) in one process: 2 workers, each
    the AdamW of the run over its two ranks' samples; every ``every`` steps after ``warmup`` synchronous ones,
    delta = mean_m(anchor - theta_m); v = mu v + delta; anchor -= lr (delta + mu v) (Nesterov); theta_m = anchor.
    Returns worker 0's loss per step and the final parameters."""
    from disttrain_core.config import compose, typed_config
    from disttrain_core.data.loader import MicrobatchLoader
    from disttrain_core.data.reader import ShardStream, resolve_shards
    from disttrain_core.data.samples import SampleEncoder
    from disttrain_core.data.tokenizer import build_tokenizer
    from disttrain_core.models import build_model, materialize
    from disttrain_core.train.optim import build_optimizer, build_scheduler

    cfg = typed_config(compose([f"data.path={shards}", *COMMON, *MESH]))
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    paths = resolve_shards(cfg.data.path)
    micro, world = cfg.optim.micro_batch_size, 4
    per_rank = cfg.optim.global_batch_size // (micro * world)
    loaders = [
        MicrobatchLoader(
            ShardStream(paths, rank, world, seed=cfg.trainer.seed, shuffle=False),
            SampleEncoder(cfg.model, tokenizer, cfg.trainer.seed, cfg.data.max_image_pixels, cfg.data.video_frames),
            micro,
            per_rank,
        )
        for rank in range(world)
    ]
    base = build_model(cfg.model, tokenizer, device="meta")
    materialize(base, "cpu", seed=cfg.trainer.seed, std=cfg.model.init_std)
    workers = [copy.deepcopy(base) for _ in range(2)]
    optims = [build_optimizer([(n, p) for n, p in w.named_parameters()], cfg.optim) for w in workers]
    scheds = [build_scheduler(o, cfg.optim, cfg.trainer.max_steps) for o in optims]
    anchor = {n: p.detach().clone() for n, p in base.named_parameters()}
    velocity = {n: torch.zeros_like(p) for n, p in anchor.items()}
    losses = []
    for step in range(1, STEPS + 1):
        batches = [loader.next_step() for loader in loaders]
        sync_step = step <= warmup
        tokens = [sum(mb.loss_tokens() for mb in batches[r]) for r in range(world)]
        for m, model in enumerate(workers):
            ranks = range(world) if sync_step else (2 * m, 2 * m + 1)
            normalizer = float(sum(tokens[r] for r in ranks))
            model.zero_grad(set_to_none=True)
            total = 0.0
            for r in ranks:
                for mb in batches[r]:
                    out = model(mb)
                    (out["lm_loss_sum"] / normalizer).backward()
                    total += out["lm_loss_sum"].item()
            if m == 0:
                losses.append(total / normalizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            optims[m].step()
            scheds[m].step()
        if step == warmup:
            anchor = {n: p.detach().clone() for n, p in workers[0].named_parameters()}
        if step > warmup and (step - warmup) % every == 0:
            with torch.no_grad():
                params = [dict(w.named_parameters()) for w in workers]
                for name in anchor:
                    delta = sum(anchor[name] - p[name] for p in params) / len(params)
                    velocity[name] = momentum * velocity[name] + delta
                    anchor[name] = anchor[name] - outer_lr * (delta + momentum * velocity[name])
                for p in params:
                    for name, value in anchor.items():
                        p[name].copy_(value)
    return losses, {n: p.detach() for n, p in workers[0].named_parameters()}


def test_diloco_on_a_2x2_mesh_is_the_update_rule(long_text, tmp_path):
    warmup, every, lr, mu = 2, 2, 0.7, 0.9
    losses, params = _train(
        long_text,
        tmp_path / "diloco",
        *MESH,
        f"parallel.local_sgd.warmup_steps={warmup}",
        f"parallel.local_sgd.sync_every={every}",
        f"parallel.local_sgd.outer_lr={lr}",
        f"parallel.local_sgd.outer_momentum={mu}",
    )
    ref_losses, ref_params = _reference_diloco(long_text, warmup, every, lr, mu)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5, (losses, ref_losses)
    assert _close(params, ref_params) < 1e-5


# make test keeps the case with the most state (edit, zero3); the others run in make test-slow.
@pytest.mark.parametrize(
    "method,shard",
    [
        pytest.param("diloco", "none", marks=pytest.mark.slow),
        pytest.param("edit", "none", marks=pytest.mark.slow),
        pytest.param("edit", "zero1", marks=pytest.mark.slow),
        ("edit", "zero3"),
    ],
)
def test_a_run_resumed_between_two_syncs_continues_identically(long_text, tmp_path, method, shard):
    """Step 3 lies between the syncs of steps 2 (the end of warm-up), 4 and 6: the checkpoint carries every
    worker's parameters and inner optimizer, the anchors, the outer momentum and the step (edit: with its
    layer-wise sync and its penalty's detector statistics, both on by default; zero3: all of it sharded over
    each worker's processes, anchors and outer momentum as DTensors placed like the parameters)."""
    settings = [
        *MESH,
        f"parallel.shard={shard}",
        f"parallel.local_sgd.method={method}",
        "parallel.local_sgd.warmup_steps=2",
        "parallel.local_sgd.sync_every=2",
    ]
    whole, whole_params = _train(long_text, tmp_path / "whole", *settings)
    stopped = tmp_path / "stopped"
    _train(long_text, stopped, *settings, "trainer.checkpoint.every_n_steps=3", "trainer.exit_after_step=3")
    result = run_train(cli_overrides(long_text, stopped) + COMMON + settings + ["trainer.resume=auto"])
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = [m for m in read_metrics(stopped) if m["step"] > 3]
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert max(abs(m["loss"] - whole[m["step"] - 1]) for m in resumed) < 1e-6
    assert _close(whole_params, read_tensors(latest_checkpoint(stopped / "checkpoints"))) < 1e-6


def test_layerwise_sync_in_the_forward_equals_syncing_every_layer_at_once(long_text, tmp_path):
    """EDiT's timing: the sync due after step 4 runs block by block in step 5's forward (the run's last, after
    step 6, at once: no forward follows); the losses of steps 5-6 and the parameters are the same."""
    settings = [*MESH, "parallel.local_sgd.warmup_steps=2", "parallel.local_sgd.sync_every=2"]
    at_once, at_once_params = _train(long_text, tmp_path / "at_once", *settings)
    layerwise, layerwise_params = _train(
        long_text, tmp_path / "layerwise", *settings, "parallel.local_sgd.layerwise=true"
    )
    assert max(abs(a - b) for a, b in zip(at_once, layerwise, strict=True)) < 1e-6
    assert _close(at_once_params, layerwise_params) < 1e-6


# EDiT's penalty: 4 workers of one process, inner SGD (a scaled loss scales the pseudo-gradient), 10
# synchronous steps (past the steepest fall of the norms), then a sync after every step; worker 3's loss is
# scaled by 20 on 30% of the steps from step 20 (after the EWMA's 8 syncs).
PENALTY_RUN = [
    "parallel=local_sgd",
    "parallel.local_sgd.shard_group=1",
    "parallel.local_sgd.warmup_steps=10",
    "parallel.local_sgd.sync_every=1",
    "parallel.local_sgd.outer_lr=1",
    "parallel.local_sgd.outer_momentum=0",
    "optim=sgd",
    "optim.lr=0.05",
    "optim.grad_clip=0",
    "trainer.max_steps=50",
    "trainer.checkpoint.every_n_steps=100",
]
DETECT = [
    "parallel.local_sgd.penalty.anomaly=true",
    "parallel.local_sgd.penalty.ewma_warmup=8",
    "parallel.local_sgd.penalty.ewma_alpha=0.2",  # 40 syncs while the norms fall 10x: follow them faster
]
SPIKES = [
    "parallel.local_sgd.spikes.workers=[3]",
    "parallel.local_sgd.spikes.probability=0.3",
    "parallel.local_sgd.spikes.scale=50",
    "parallel.local_sgd.spikes.start_step=20",
]


def _penalty_run(shards, run_dir, *extra):
    result = run_train(cli_overrides(shards, run_dir) + COMMON + PENALTY_RUN + list(extra))
    assert result.returncode == 0, result.stderr[-3000:]
    return [m["loss"] for m in read_metrics(run_dir)]


@pytest.mark.slow  # 28 s; the penalty's rollback path stays in make test (every worker anomalous)
def test_the_penalty_finds_the_spikes_and_keeps_the_loss_of_a_clean_run(long_text, tmp_path):
    import json

    clean = _penalty_run(long_text, tmp_path / "clean", *DETECT)
    penalized = _penalty_run(long_text, tmp_path / "penalized", *DETECT, *SPIKES)
    plain = _penalty_run(long_text, tmp_path / "plain", *SPIKES)
    syncs = [json.loads(line) for line in (tmp_path / "penalized" / "local_sgd_syncs.jsonl").read_text().splitlines()]
    flagged: dict[tuple[int, int], bool] = {}
    injected: dict[tuple[int, int], bool] = {}
    for sync in syncs:
        if sync["step"] < 20:  # the EWMA's warm-up
            continue
        for worker, anomalous in enumerate(sync["anomalous"]):
            key = (sync["step"], worker)
            flagged[key] = flagged.get(key, False) or anomalous
            injected[key] = worker in sync["spiked"]
    spiked = [k for k in injected if injected[k]]
    clean_pairs = [k for k in injected if not injected[k]]
    recall = sum(flagged[k] for k in spiked) / len(spiked)
    false_positives = sum(flagged[k] for k in clean_pairs) / len(clean_pairs)
    tail = slice(-5, None)
    ratio = sum(penalized[tail]) / sum(clean[tail])
    degraded = sum(plain[tail]) / sum(clean[tail])
    print(
        f"recall {recall:.2f} over {len(spiked)} spiked syncs, false positives {false_positives:.3f} over "
        f"{len(clean_pairs)}; final loss penalized / clean {ratio:.3f}, plain / clean {degraded:.3f}"
    )
    assert len(spiked) >= 5 and recall >= 0.9 and false_positives <= 0.1
    assert abs(ratio - 1) <= 0.05
    assert degraded > 1.05


def test_when_every_worker_is_anomalous_the_parameters_roll_back(long_text, tmp_path):
    every = [
        "parallel.local_sgd.spikes.workers=[0,1,2,3]",
        "parallel.local_sgd.spikes.probability=1",
        "parallel.local_sgd.spikes.scale=50",
        "parallel.local_sgd.spikes.start_step=20",
    ]
    run_dir = tmp_path / "rollback"
    # with outer momentum, a zero combined pseudo-gradient would still move the anchor: only a skipped step
    # brings the parameters back
    kept = [o for o in PENALTY_RUN[:-2] if "outer_" not in o] + ["parallel.local_sgd.outer_momentum=0.9"]
    result = run_train(
        cli_overrides(long_text, run_dir)
        + COMMON
        + kept
        + DETECT
        + every
        + ["trainer.max_steps=22", "trainer.checkpoint.every_n_steps=19", "trainer.checkpoint.keep_last=3"]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert sum(m.get("local_sgd/rollbacks", 0) for m in metrics) > 0
    before = read_tensors(run_dir / "checkpoints" / "step_00000019")
    after = read_tensors(latest_checkpoint(run_dir / "checkpoints"))
    assert _close(before, after) == 0.0  # steps 20-22 rolled back to the sync of step 19


SHARDED_RUN = [
    *MESH,
    "parallel.local_sgd.method=edit",
    "parallel.local_sgd.warmup_steps=2",
    "parallel.local_sgd.sync_every=2",
    "optim.grad_clip=0.5",  # clipped by the worker's norm, summed over the shards
]


@pytest.fixture(scope="module")
def ddp_workers(long_text, tmp_path_factory):
    """The reference of the sharded runs: edit with DDP workers (losses, the whole checkpoint)."""
    run_dir = tmp_path_factory.mktemp("ddp_workers")
    losses, _ = _train(long_text, run_dir, *SHARDED_RUN)
    return losses, read_tensors(latest_checkpoint(run_dir / "checkpoints"), "")


@pytest.mark.parametrize("shard", ["zero1", pytest.param("zero2", marks=pytest.mark.slow), "zero3"])
def test_sharded_workers_equal_ddp_workers(long_text, tmp_path, ddp_workers, shard):
    """EDiT's 2-D mesh with sharded workers: each worker's 2 processes (the shard group) shard its state -- ZeRO-1
    its AdamW state, FSDP2 (zero2, zero3) everything -- and the sync group joins the processes that hold the same
    shards. edit (layer-wise sync before FSDP2 gathers a block, the penalty's norms summed over the shards) gives
    the losses and the checkpoint -- every worker's parameters and AdamW state, the anchors, the outer momentum --
    of DDP workers."""
    ddp_losses, ddp_state = ddp_workers
    losses, _ = _train(long_text, tmp_path / shard, *SHARDED_RUN, f"parallel.shard={shard}")
    assert max(abs(a - b) for a, b in zip(ddp_losses, losses, strict=True)) < 1e-5, (ddp_losses, losses)
    state = read_tensors(latest_checkpoint(tmp_path / shard / "checkpoints"), "")
    for part in ("model.", "optim.", "local_sgd.worker1.model.", "local_sgd.worker1.optim.", "local_sgd.anchor."):
        assert any(k.startswith(part) for k in state), part
    assert any(k.endswith("momentum_buffer") for k in state)
    assert _close(ddp_state, state) < 1e-5
