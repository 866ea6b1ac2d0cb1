"""Local SGD against synchronous data parallelism on two emulated nodes: tokens/s, held-out loss and loss
curves of ``parallel=dp``, DiLoCo, EDiT and A-EDiT (docs/LOCAL_SGD.md, docs/performance/local_sgd.md).

Setting (fixed before measuring): two nodes of tools/netem_cluster.py (network namespaces joined by a link
shaped to ``rate``), each node one process pinned to its own core (``pin=true``, one torch thread), fp32,
a Llama of MODEL's shape on the embedded LAION-like captions (text only), ``steps`` steps of
``global_batch`` samples (synchronous DP: the whole batch each step over both nodes; local SGD: each worker
its half each step). Local-SGD runs start with ``warmup`` synchronous steps, then sync every ``sync_every``
steps (DiLoCo, EDiT) or every ``interval`` seconds (A-EDiT; ``auto``: ``sync_every`` x worker 0's median
local step time in the DiLoCo run of the same scenario, so A-EDiT's fast worker syncs about as often as
EDiT does). Outer optimizer: Nesterov SGD, ``outer_lr`` 0.7, ``outer_momentum`` 0.5 (DiLoCo's 0.9 is tuned
for hundreds of inner steps per sync; at 9 syncs of 16 it left the held-out loss 42% above synchronous DP:
docs/LOCAL_SGD.md); EDiT and A-EDiT with their defaults (layer-wise sync, anomaly elimination, softmax
weighting); A-EDiT also weights the workers half by their steps since the last sync (``step_weight``).

Scenarios: ``straggler`` -- ``straggler_rate`` link, node 1 persistently ``factor`` x slower
(trainer.straggler: busy work of (factor - 1) x its step's CPU time); ``slow_link`` -- ``slow_rate`` link, no
straggler.

Measured per run, after the first ``warmup`` steps (the same count skipped for every method): tokens/s = the
tokens all workers trained on (samples x seq_len; A-EDiT: each worker's own step count from its sync log) /
rank 0's wall time from the end of step ``warmup`` to the end of the run (every run ends at a sync, where
rank 0 meets the others; its logged step times would leave out the waits in the trainer's per-step stop-flag
reduction, train/stop.py, which is where a fast DiLoCo or EDiT worker waits for a slow one); and the final
model's mean loss per token on ``heldout`` samples of a separately generated shard (the run ends at a sync:
every worker holds the same parameters). Reported: each method's tokens/s / synchronous DP's and held-out
loss / synchronous DP's, per scenario; a PNG of every run's training loss (rank 0's) against wall seconds.

    sudo python tools/bench_local_sgd.py                        # about 14 minutes here
    sudo python tools/bench_local_sgd.py scenarios=slow_link methods=dp,edit steps=48 format=json
    sudo python tools/bench_local_sgd.py optim.lr=1e-3          # other names: Hydra overrides for every run
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disttrain_core.config import REPO_ROOT  # noqa: E402
from disttrain_core.launch.cli import split_tool_args, tool_main  # noqa: E402

OPTIONS = {
    "scenarios": "straggler,slow_link",
    "methods": "dp,diloco,edit,a_edit",
    "steps": "160",
    "warmup": "16",
    "sync_every": "16",
    "outer_lr": "0.7",
    "outer_momentum": "0.5",
    "step_weight": "0.5",  # A-EDiT: sync weights mixed half with each worker's share of the steps
    "interval": "auto",
    "global_batch": "16",
    "micro_batch": "8",
    "straggler_rate": "1gbit",
    "factor": "1.5",
    "slow_rate": "100mbit",
    "heldout": "256",
    "format": "text",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_local_sgd.json"),
    "picture": str(REPO_ROOT / "docs" / "results" / "bench_local_sgd.png"),
}
# llama_tiny widened to 3.3M parameters (13 MB of fp32 gradients): at 100 Mbit/s one all-reduce of them takes
# about as long as a step's compute on one core.
MODEL = [
    "model=llama_tiny",
    "model.seq_len=128",
    "model.llm.dim=256",
    "model.llm.n_heads=8",
    "model.llm.n_kv_heads=4",
    "model.llm.ffn_dim=704",
]


def _args(options: dict[str, str], method: str, scenario: str, interval: float | None) -> list[str]:
    args = [
        *MODEL,
        "trainer.num_nodes=2",
        "trainer.devices=1",
        "trainer.threads_per_rank=1",
        "trainer.precision=32",
        f"trainer.max_steps={options['steps']}",
        "trainer.log_every_n_steps=1",
        "trainer.progress_bar=false",
        "trainer.checkpoint.every_n_steps=0",
        "trainer.checkpoint.save_last=true",
        "trainer.checkpoint.async_save=false",
        f"optim.global_batch_size={options['global_batch']}",
        f"optim.micro_batch_size={options['micro_batch']}",
        "data.num_workers=1",
        f"data.path={options['_train_dir']}",
        "data.generate_if_missing=false",
        "logger.tensorboard=false",
    ]
    if scenario == "straggler":
        args += ["trainer.straggler.ranks=[1]", f"trainer.straggler.factor={options['factor']}"]
    if method == "dp":
        return args + ["parallel=dp"]
    args += [
        "parallel=local_sgd",
        "parallel.local_sgd.shard_group=1",
        f"parallel.local_sgd.method={method}",
        f"parallel.local_sgd.warmup_steps={options['warmup']}",
        f"parallel.local_sgd.sync_every={options['sync_every']}",
        f"parallel.local_sgd.outer_lr={options['outer_lr']}",
        f"parallel.local_sgd.outer_momentum={options['outer_momentum']}",
    ]
    if method == "a_edit":
        args.append(f"parallel.local_sgd.sync_interval_s={interval:.3f}")
        args.append(f"parallel.local_sgd.step_weight={options['step_weight']}")
    return args


def run(options: dict[str, str], method: str, scenario: str, run_dir: Path, interval: float | None = None) -> dict:
    rate = options["straggler_rate"] if scenario == "straggler" else options["slow_rate"]
    train = [sys.executable, str(REPO_ROOT / "train.py"), *_args(options, method, scenario, interval)]
    train += [*json.loads(options["_extra"]), f"hydra.run.dir={run_dir}"]
    cluster = [sys.executable, str(REPO_ROOT / "tools" / "netem_cluster.py"), "nodes=2", f"rate={rate}", "pin=true"]
    result = subprocess.run([*cluster, "timeout=3000", "--", *train], capture_output=True, text=True, cwd=REPO_ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{method} ({scenario}) failed:\n{result.stderr[-2500:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    skip, steps, batch = int(options["warmup"]), int(options["steps"]), int(options["global_batch"])
    seq = int(next(a for a in MODEL if a.startswith("model.seq_len=")).split("=")[1])
    rounds_file = run_dir / "local_sgd_rounds.jsonl"
    if method == "a_edit":
        last = json.loads(rounds_file.read_text().splitlines()[-1])
        samples = sum(s - skip for s in last["steps"]) * batch // 2
        per_worker = last["steps"]
    else:
        samples = (steps - skip) * batch
        per_worker = [steps, steps]
    # wall time on rank 0 from the end of step ``skip`` to the end of the last step: its logged step times leave
    # out the wait in the loop's per-step stop-flag reduction, where a fast worker of DiLoCo or EDiT waits for
    # the slow one (train/stop.py)
    start = next(r["time"] for r in rows if r["step"] == skip)
    seconds = rows[-1]["time"] - start
    local = [r["perf/step_time_s"] for r in rows if r["step"] > skip]
    curve = [(round(r["time"] - rows[0]["time"] + rows[0]["perf/step_time_s"], 3), round(r["loss"], 4)) for r in rows]
    return {
        "tokens_per_s": samples * seq / seconds,
        "seconds_after_warmup": seconds,
        "steps_per_worker": per_worker,
        "median_step_s": statistics.median(local),  # rank 0's logged step time (A-EDiT's interval: auto)
        "heldout_loss": heldout_loss(run_dir, options),
        "curve": curve,
    }


def heldout_loss(run_dir: Path, options: dict[str, str]) -> float:
    """Mean loss per label token of the run's last checkpoint (worker 0's parameters) on the held-out shard."""
    import torch

    from disttrain_core.config import compose, typed_config
    from disttrain_core.data.loader import MicrobatchLoader
    from disttrain_core.data.reader import ShardStream, resolve_shards
    from disttrain_core.data.samples import SampleEncoder
    from disttrain_core.data.tokenizer import tokenizer_for
    from disttrain_core.models import build_model, materialize
    from disttrain_core.train.checkpoint import latest_checkpoint, read_tensors

    cfg = typed_config(compose([*MODEL, f"data.path={options['_heldout_dir']}", "data.generate_if_missing=false"]))
    tokenizer = tokenizer_for(cfg)
    model = build_model(cfg.model, tokenizer, device="meta")
    materialize(model, "cpu", seed=0, std=cfg.model.init_std)
    weights = read_tensors(latest_checkpoint(run_dir / "checkpoints"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if "rope" not in m and "freqs" not in m]:
        raise SystemExit(f"checkpoint does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.eval()
    micro = 16
    stream = ShardStream(resolve_shards(cfg.data.path), 0, 1, seed=0, shuffle=False)
    encoder = SampleEncoder(cfg.model, tokenizer, 0, cfg.data.max_image_pixels, cfg.data.video_frames)
    loader = MicrobatchLoader(stream, encoder, micro, 1)
    total = tokens = 0.0
    with torch.no_grad():
        for _ in range(int(options["heldout"]) // micro):
            for batch in loader.next_step():
                out = model(batch)
                total += float(out["lm_loss_sum"])
                tokens += float(batch.loss_tokens())
    return total / tokens


def make_shards(train: Path, heldout: Path) -> None:
    """The embedded data's shards (its generator's defaults), written once before the runs so the two nodes
    do not both generate them; and one held-out shard from a generator seed the training shards do not use."""
    from disttrain_core.config import SyntheticDataConfig
    from disttrain_core.data.synthetic import generate_shards

    generate_shards(SyntheticDataConfig(), train, processes=1)
    generate_shards(SyntheticDataConfig(num_shards=1, samples_per_shard=512, seed=98765), heldout, processes=1)


def measure(options: dict[str, str]) -> dict:
    methods = options["methods"].split(",")
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        options = {**options, "_heldout_dir": str(Path(tmp) / "heldout"), "_train_dir": str(Path(tmp) / "train")}
        make_shards(Path(options["_train_dir"]), Path(options["_heldout_dir"]))
        for scenario in options["scenarios"].split(","):
            runs: dict = {}
            interval = None if options["interval"] == "auto" else float(options["interval"])
            for method in methods:
                if method == "a_edit" and interval is None:
                    if "diloco" not in runs:
                        runs["diloco"] = run(options, "diloco", scenario, Path(tmp) / f"{scenario}-diloco")
                    interval = int(options["sync_every"]) * runs["diloco"]["median_step_s"]
                if method not in runs:
                    runs[method] = run(options, method, scenario, Path(tmp) / f"{scenario}-{method}", interval)
                if options["format"] == "text":
                    r = runs[method]
                    print(
                        f"{scenario} {method}: {r['tokens_per_s']:,.0f} tok/s, held-out loss {r['heldout_loss']:.4f}, "
                        f"steps per worker {r['steps_per_worker']}",
                        flush=True,
                    )
            base = runs.get("dp")
            for r in runs.values():
                if base is not None:
                    r["throughput_vs_dp"] = r["tokens_per_s"] / base["tokens_per_s"]
                    r["heldout_loss_vs_dp"] = r["heldout_loss"] / base["heldout_loss"]
            out[scenario] = {
                "rate": options["straggler_rate"] if scenario == "straggler" else options["slow_rate"],
                "straggler_factor": float(options["factor"]) if scenario == "straggler" else 1.0,
                "a_edit_interval_s": interval,
                "runs": runs,
            }
    return out


def draw(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(results)
    fig, axes = plt.subplots(1, len(scenarios), figsize=(6.5 * len(scenarios), 4.2), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        entry = results[scenario]
        for method, r in entry["runs"].items():
            xs = [x for x, _ in r["curve"]]
            ys, smooth = [], None
            for _, y in r["curve"]:
                smooth = y if smooth is None else 0.9 * smooth + 0.1 * y
                ys.append(smooth)
            label = f"{method}: {r['tokens_per_s']:,.0f} tok/s, held-out {r['heldout_loss']:.3f}"
            ax.plot(xs, ys, label=label)
        title = f"{scenario}: {entry['rate']} link"
        if entry["straggler_factor"] > 1:
            title += f", node 1 {entry['straggler_factor']}x slower"
        ax.set_title(title)
        ax.set_xlabel("seconds (rank 0's wall clock)")
        ax.set_ylabel("training loss (rank 0, EMA 0.9)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    options, extra = split_tool_args(argv, OPTIONS)
    options["_extra"] = json.dumps(extra)  # Hydra overrides for every run
    import os

    out = Path(options["out"])
    if os.geteuid() != 0 or not shutil.which("tc"):
        reason = "the emulated nodes need root and iproute2 (tools/netem_cluster.py): run with sudo"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"skipped": reason}) + "\n")
        print(f"skipped: {reason}")
        return 0
    steps, warmup, every = int(options["steps"]), int(options["warmup"]), int(options["sync_every"])
    if (steps - warmup) % every:
        raise SystemExit(
            f"steps - warmup = {steps - warmup} must be a multiple of sync_every={every}: runs end at a sync"
        )
    results = {
        "command": "python tools/bench_local_sgd.py " + " ".join(argv),
        "model_overrides": MODEL,
        "options": {k: v for k, v in options.items() if not k.startswith("_")},
    }
    results["scenarios"] = measure(options)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    if options["picture"] != "none":
        draw(results["scenarios"], options["picture"])
    if options["format"] == "json":
        print(json.dumps(results, indent=2))
        return 0
    for scenario, entry in results["scenarios"].items():
        for method, r in entry["runs"].items():
            if "throughput_vs_dp" in r and method != "dp":
                print(
                    f"{scenario}: {method} / dp tokens/s {r['throughput_vs_dp']:.3f}, held-out loss "
                    f"{r['heldout_loss_vs_dp']:.4f}x dp's"
                )
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
