"""Training throughput and MFU on this machine, and the framework's overhead.

For each model (mllm_tiny, llama_tiny) and precision (fp32, bf16 autocast) it measures:

* framework: ``train.py``'s real path in one process (Fabric, loader with a decode worker,
  global-batch loss normalization, clipping, scheduler, metrics, progress) -- tokens/s from
  the wall-clock timestamps in metrics.jsonl between the end of the warm-up and the last step;
* minimal: a hand-written PyTorch loop on the same model, initialization, optimizer and
  data, reading and decoding the shards inline as a simple script would;
* compute_only: the same loop on microbatches decoded before the clock starts (no data cost);
* the measured matmul peak FLOP/s in fp32 and bf16 with the same thread count; MFU of both.

The headline ratio is the median over repeats of framework / minimal measured back to back
(``framework_over_minimal_paired``): adjacent runs share the machine's state of the moment.

The three kinds of run rotate (``repeats`` times) and medians are reported, because
this machine is shared and noisy. Optionally (``ddp=true``) it also times the framework
with 2 processes. Results go to ``out`` (JSON); docs/performance/training.md summarizes them.

    python tools/bench_train.py                          # ~15 minutes on 2 cores
    python tools/bench_train.py steps=20 repeats=1 ddp=false models=mllm_tiny

tools/bench_litgpt_cli.py compares the two entry points instead: ``python train.py`` and the stock ``litgpt pretrain``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from disttrain_core.config import REPO_ROOT, compose
from disttrain_core.launch.cli import split_tool_args, tool_main
from disttrain_core.launch.entry import launch
from disttrain_core.models.flops import batch_flops
from disttrain_core.train.perf import measure_matmul_peak

OPTIONS = {
    "models": "mllm_tiny,llama_tiny",
    "precisions": "32,bf16-mixed",
    "steps": "30",
    "warmup": "10",
    "repeats": "7",
    "ddp": "true",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_train.json"),
    # litgpt=true adds, litgpt=only runs just, the comparison with LitGPT (its own venv, .venv-litgpt, created on
    # first use from tools/requirements-litgpt.txt) on the Llama shape below, alternating in one run: LitGPT's loop
    # re-created around its model. tools/bench_litgpt_cli.py runs the stock `litgpt pretrain` CLI instead
    "litgpt": "false",
    "litgpt_precision": "32",
    # tokens: the framework reads the pre-tokenized windows it hands LitGPT (data=tokens); default: it reads its
    # default webdataset shards through its decode worker, LitGPT still the windows in memory
    "litgpt_data": "tokens",
    "litgpt_repeats": "5",
    "litgpt_out": str(REPO_ROOT / "docs" / "results" / "bench_train_litgpt.json"),
}
# The Llama shape of the LitGPT comparison (issue 19): 8 layers, width 512, GQA 8/4, SwiGLU 1,536, sequence 512,
# micro-batch 8, one microbatch per step; the byte tokenizer's 384-token vocabulary.
LITGPT_SHAPE = {"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 1536, "seq_len": 512}
LITGPT_MICRO, LITGPT_ACCUMULATION = 8, 1
LITGPT_VENV = REPO_ROOT / ".venv-litgpt"


LOG_EVERY = 5  # the framework logs (TensorBoard + jsonl) every 5 steps, as a real run would


def _overrides(model: str, precision: str, run_dir: Path, steps: int, devices: int = 1) -> list[str]:
    return [
        f"model={model}",
        f"trainer.precision={precision}",
        f"trainer.max_steps={steps}",
        f"trainer.log_every_n_steps={LOG_EVERY}",
        "trainer.checkpoint.every_n_steps=0",
        "trainer.checkpoint.save_last=false",
        "trainer.progress_bar=false",
        "trainer.accelerator=cpu",
        f"trainer.devices={devices}",
        f"paths.output_dir={run_dir}",
        "cluster.peak_flops_fp32=1",
        "cluster.peak_flops_bf16=1",
    ]


def framework_run(
    model: str, precision: str, steps: int, warmup: int, devices: int = 1, extra: tuple[str, ...] = ()
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose(_overrides(model, precision, Path(tmp), warmup + steps, devices) + list(extra))
        launch(cfg)
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return framework_rates(records, warmup, cfg.model.seq_len, devices)


def framework_rates(records: list[dict], warmup: int, seq_len: int, devices: int = 1) -> dict:
    """Tokens/s (and FLOP/s) of a run's metrics.jsonl records between the end of the warm-up and the last step."""
    # Records close windows of LOG_EVERY steps; time the windows after the warm-up, wall clock.
    start = next(r for r in records if r["step"] == warmup)
    timed = [r for r in records if r["step"] > warmup]
    seconds = timed[-1]["time"] - start["time"]
    window = LOG_EVERY * 1.0
    sequences = sum(r["perf/samples_per_s"] * r["perf/step_time_s"] * window for r in timed)
    flops = sum(r["perf/tflops_per_device"] * devices * 1e12 * r["perf/step_time_s"] * window for r in timed)
    return {
        "tokens_per_s": sequences * seq_len / seconds,
        "flops_per_s": flops / seconds,
        "data_wait_fraction": statistics.mean(r["perf/data_wait_fraction"] for r in timed),
    }


def minimal_run(model: str, precision: str, steps: int, warmup: int, predecoded: bool) -> dict:
    """The same work with nothing but PyTorch: read, forward, backward, AdamW step.

    The loop reads the same shards with the same sample decoding, inline (no worker
    processes), as a hand-written script would. With ``predecoded`` the microbatches are
    decoded before the clock starts: the compute-only ceiling.
    """
    from disttrain_core.data.loader import MicrobatchLoader
    from disttrain_core.data.reader import ShardStream, resolve_shards
    from disttrain_core.data.samples import SampleEncoder
    from disttrain_core.data.tokenizer import ByteTokenizer
    from disttrain_core.models import build_model, materialize

    cfg = compose(_overrides(model, precision, Path("/tmp"), steps))
    tokenizer = ByteTokenizer()
    net = build_model(cfg.model, tokenizer)
    materialize(net, "cpu", seed=cfg.trainer.seed, std=cfg.model.init_std)
    optimizer = torch.optim.AdamW(net.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, foreach=True)
    loader = MicrobatchLoader(
        ShardStream(resolve_shards(cfg.data.path), 0, 1, seed=cfg.trainer.seed),
        SampleEncoder(cfg.model, tokenizer, cfg.trainer.seed, cfg.data.max_image_pixels, cfg.data.video_frames),
        cfg.optim.micro_batch_size,
        cfg.optim.global_batch_size // cfg.optim.micro_batch_size,
    )
    predecoded_steps = iter([loader.next_step() for _ in range(warmup + steps)]) if predecoded else None
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    flops = 0.0
    for index in range(warmup + steps):
        if index == warmup:
            start = time.perf_counter()
        microbatches = next(predecoded_steps) if predecoded else loader.next_step()
        for batch in microbatches:
            with autocast:
                out = net(batch)
            loss = out["lm_loss_sum"] / out["lm_tokens"]
            if "gen_loss_sum" in out:
                loss = loss + out["gen_loss_sum"] / out["gen_samples"].clamp(min=1)
            loss.backward()
            if index >= warmup:
                flops += batch_flops(
                    cfg.model,
                    batch.size,
                    int(batch.images.shape[0]),
                    batch.size if cfg.model.generator is not None else 0,
                )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    sequences = steps * cfg.optim.global_batch_size
    return {"tokens_per_s": sequences * cfg.model.seq_len / seconds, "flops_per_s": flops / seconds}


def litgpt_python() -> Path:
    """The LitGPT venv's interpreter, creating the venv on first use (about a minute with a local torch wheel) and
    installing tools/requirements-litgpt*.txt again whenever they differ from what the venv was made with."""
    python = LITGPT_VENV / "bin" / "python"
    files = [REPO_ROOT / "tools" / f"requirements-litgpt{suffix}.txt" for suffix in ("", "-nodeps")]
    wanted = "".join(path.read_text() for path in files)
    installed = LITGPT_VENV / "requirements-litgpt.txt"  # what the venv was last installed from
    if not python.exists():
        print(f"creating {LITGPT_VENV} from tools/requirements-litgpt.txt", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(LITGPT_VENV)], check=True)
    if not installed.is_file() or installed.read_text() != wanted:
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "-r", str(files[0])], check=True)
        subprocess.run([*pip, "--no-deps", "-r", str(files[1])], check=True)
        installed.write_text(wanted)
    return python


def litgpt_version(python: Path) -> str:
    code = "import importlib.metadata as m; print(m.version('litgpt'), m.version('torch'))"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def litgpt_setup(
    tmp: Path,
    precision: str,
    steps: int,
    warmup: int,
    shape: dict = LITGPT_SHAPE,
    micro: int = LITGPT_MICRO,
    accumulation: int = LITGPT_ACCUMULATION,
) -> tuple:
    """train.py's config of the LitGPT comparison, its overrides (``shape``: the shape and batch; ``data``:
    data=tokens over a token file written to ``tmp``) and the windows it trains on, step by step:
    [warmup + steps, accumulation, micro, seq_len + 1] token ids, as its own loader yields them."""
    import numpy as np

    from disttrain_core.data.token_file import TokenFileLoader

    tokens = tmp / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 384, 1 << 20).astype(np.uint16))
    data = ("data=tokens", f"data.path={tokens}")
    extra = (
        *(f"model.llm.{k}={v}" for k, v in shape.items() if k != "seq_len"),
        f"model.seq_len={shape['seq_len']}",
        f"optim.micro_batch_size={micro}",
        f"optim.global_batch_size={micro * accumulation}",
    )
    cfg = compose(_overrides("llama_tiny", precision, tmp, warmup + steps) + list(extra + data))
    loader = TokenFileLoader(tokens, cfg.model.seq_len, micro, accumulation, cfg.model.llm.vocab_size, cfg.trainer.seed)
    windows = [
        [torch.cat([mb.tokens, mb.labels[:, -1:]], dim=1).numpy() for mb in loader.next_step()]
        for _ in range(warmup + steps)
    ]
    return cfg, extra, data, np.asarray(windows, dtype=np.int64)


def litgpt_comparison(options: dict, steps: int, warmup: int, threads: int) -> dict:
    """train.py and LitGPT on the same Llama shape and precision, alternating. LitGPT reads token windows from
    memory; the framework reads the same windows from a pre-tokenized file (``litgpt_data=tokens``: data=tokens,
    memory-mapped) or its default shards, decoded by its worker process (``litgpt_data=default``)."""
    import numpy as np

    precision, repeats = options["litgpt_precision"], int(options["litgpt_repeats"])
    python = litgpt_python()
    with tempfile.TemporaryDirectory() as tmp:
        cfg, extra, data, windows = litgpt_setup(Path(tmp), precision, steps, warmup)
        if options["litgpt_data"] == "tokens":
            extra += data
        np.save(Path(tmp) / "windows.npy", windows)
        llm = cfg.model.llm
        spec = {
            "windows": str(Path(tmp) / "windows.npy"),
            "warmup": warmup,
            "log_every": LOG_EVERY,
            "threads": threads,
            "seed": cfg.trainer.seed,
            "precision": {"32": "32-true", "bf16-mixed": "bf16-mixed"}[precision],
            "lr": cfg.optim.lr,
            "weight_decay": cfg.optim.weight_decay,
            "betas": list(cfg.optim.betas),
            "shape": {
                "vocab_size": llm.vocab_size,
                **{k: v for k, v in LITGPT_SHAPE.items() if k != "seq_len"},
                "norm_eps": llm.norm_eps,
                "rope_theta": llm.rope_theta,
            },
        }
        runs: dict[str, list[float]] = {"framework": [], "litgpt": []}
        for repeat in range(repeats):  # alternate which goes first
            for kind in ("framework", "litgpt") if repeat % 2 == 0 else ("litgpt", "framework"):
                if kind == "framework":
                    value = framework_run("llama_tiny", precision, steps, warmup, extra=extra)["tokens_per_s"]
                else:
                    out = subprocess.run(
                        [str(python), str(REPO_ROOT / "tools" / "litgpt_step_timer.py"), json.dumps(spec)],
                        check=True,
                        capture_output=True,
                        text=True,
                    )
                    value = json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]
                runs[kind].append(value)
                print(f"repeat {repeat + 1}/{repeats} {kind}: {value:,.0f} tokens/s", flush=True)
    ratios = [f / g for f, g in zip(runs["framework"], runs["litgpt"], strict=True)]
    return {
        "shape": {**LITGPT_SHAPE, "micro_batch": LITGPT_MICRO, "accumulation": LITGPT_ACCUMULATION},
        "precision": precision,
        "framework_data": options["litgpt_data"],
        "steps": steps,
        "warmup": warmup,
        "litgpt": litgpt_version(python).split()[0],
        "framework_tokens_per_s": [round(v, 1) for v in runs["framework"]],
        "litgpt_tokens_per_s": [round(v, 1) for v in runs["litgpt"]],
        "paired_ratios": [round(r, 4) for r in ratios],
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def main(argv: list[str]) -> int:
    options, _ = split_tool_args(argv, OPTIONS)
    steps, warmup, repeats = int(options["steps"]), int(options["warmup"]), int(options["repeats"])
    if steps % LOG_EVERY or warmup % LOG_EVERY or warmup < LOG_EVERY:
        raise SystemExit(f"error: steps={steps} and warmup={warmup} must be positive multiples of {LOG_EVERY}")
    if options["litgpt"] not in ("true", "false", "only"):
        raise SystemExit(f"error: litgpt={options['litgpt']!r}: use true, false or only")
    if options["litgpt_data"] not in ("tokens", "default"):
        raise SystemExit(f"error: litgpt_data={options['litgpt_data']!r}: use tokens or default")
    threads = int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))
    torch.set_num_threads(threads)
    if options["litgpt"] != "false":
        result = litgpt_comparison(options, steps, warmup, threads)
        out = Path(options["litgpt_out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"threads": threads, "torch": torch.__version__, **result}, indent=1))
        print(
            f"train.py / LitGPT: median {result['ratio_median']:.3f} over {len(result['paired_ratios'])} "
            f"alternations (spread {result['ratio_min']:.3f}-{result['ratio_max']:.3f}); wrote {out}",
            flush=True,
        )
        if options["litgpt"] == "only":
            return 0
    peaks = {
        "32": measure_matmul_peak(torch.float32, torch.device("cpu")),
        "bf16-mixed": measure_matmul_peak(torch.bfloat16, torch.device("cpu")),
    }
    results = {
        "machine": {
            "threads": threads,
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "peak_flops_fp32": peaks["32"],
            "peak_flops_bf16": peaks["bf16-mixed"],
        },
        "settings": {"steps": steps, "warmup": warmup, "repeats": repeats},
        "runs": [],
    }
    for model in options["models"].split(","):
        for precision in options["precisions"].split(","):
            measured: dict[str, list[dict]] = {"framework": [], "minimal": [], "compute_only": []}
            kinds = list(measured)
            for repeat in range(repeats):  # rotate the order so drifts in machine load cancel
                for kind in kinds[repeat % 3 :] + kinds[: repeat % 3]:
                    if kind == "framework":
                        measured[kind].append(framework_run(model, precision, steps, warmup))
                    else:
                        measured[kind].append(minimal_run(model, precision, steps, warmup, kind == "compute_only"))
            entry = {"model": model, "precision": precision, "processes": 1}
            for name, runs in measured.items():
                tokens = statistics.median(r["tokens_per_s"] for r in runs)
                flops = statistics.median(r["flops_per_s"] for r in runs)
                entry[name] = {
                    "tokens_per_s": tokens,
                    "mfu": flops / peaks[precision],
                    "samples": [round(r["tokens_per_s"], 1) for r in runs],
                }
            entry["framework"]["data_wait_fraction"] = statistics.median(
                r["data_wait_fraction"] for r in measured["framework"]
            )
            # Runs of one repeat are adjacent in time, so their ratio cancels most of the machine's drift.
            paired = [
                f["tokens_per_s"] / m["tokens_per_s"]
                for f, m in zip(measured["framework"], measured["minimal"], strict=True)
            ]
            entry["framework_over_minimal_paired"] = statistics.median(paired)
            entry["paired_ratios"] = [round(r, 3) for r in paired]
            entry["framework_over_minimal"] = entry["framework"]["tokens_per_s"] / entry["minimal"]["tokens_per_s"]
            entry["framework_over_compute_only"] = (
                entry["framework"]["tokens_per_s"] / entry["compute_only"]["tokens_per_s"]
            )
            results["runs"].append(entry)
            print(json.dumps(entry), flush=True)
            if options["ddp"] == "true":
                ddp = framework_run(model, precision, steps, warmup, devices=2)
                ddp_entry = {
                    "model": model,
                    "precision": precision,
                    "processes": 2,
                    "framework": {
                        "tokens_per_s": ddp["tokens_per_s"],
                        "mfu": ddp["flops_per_s"] / peaks[precision],
                        "data_wait_fraction": ddp["data_wait_fraction"],
                    },
                }
                results["runs"].append(ddp_entry)
                print(json.dumps(ddp_entry), flush=True)
    out = Path(options["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
