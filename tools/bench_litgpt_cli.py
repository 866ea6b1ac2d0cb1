"""The stock `litgpt pretrain` CLI beside `python train.py`, each through its own entry point, as a user comparing
the two would run them: the same Llama shape, batch, steps, precision and token windows (issue 60;
docs/performance/training.md, "The stock `litgpt pretrain` CLI").

* train.py: ``python train.py model=llama_tiny data=tokens data.path=<tokens.npy> ...`` (the shape, batch and
  precision of tools/bench_train.py's LitGPT comparison) in a process of its own. Tokens/s from the wall-clock
  times in its metrics.jsonl between the end of the warm-up and the last step (bench_train's measure).
* LitGPT 0.5.13 in its own venv (.venv-litgpt, made by bench_train.litgpt_python from
  tools/requirements-litgpt.txt): ``litgpt pretrain --config <yaml> --data LitData ...``. Its data module
  (LitData's StreamingDataset of token blocks, shuffled), its loop (``torch.compile`` of the model, Fabric, chunked
  cross-entropy, clipping, warm-up then cosine learning rate, a 2-batch validation before it starts, a checkpoint
  after it ends), its CSV logger. Tokens/s from the ``time`` and ``tokens`` it logs, over the same steps.

The windows are those train.py reads (bench_train.litgpt_setup), written once as LitData chunks of one window per
item (tools/litgpt_chunks.py, which reads them back to check): the same token ids, in LitGPT's own order. The two
alternate in pairs, which goes first alternating. The JSON holds both sides' tokens/s per pair, the ratio
train.py / LitGPT per pair, the median and spread, the exact commands and the settings.

    python tools/bench_litgpt_cli.py litgpt_precision=32 litgpt_repeats=3
    python tools/bench_litgpt_cli.py litgpt_precision=bf16-mixed \
        litgpt_out=docs/results/bench_train_litgpt_cli_bf16.json
"""

from __future__ import annotations

import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import (  # noqa: E402
    LITGPT_VENV,
    LOG_EVERY,
    REPO_ROOT,
    _overrides,
    framework_rates,
    litgpt_python,
    litgpt_setup,
    litgpt_version,
)

from disttrain_core.launch.cli import tool_main, tool_options  # noqa: E402

OPTIONS = {
    "litgpt_precision": "32",  # 32 or bf16-mixed (LitGPT: 32-true or bf16-mixed)
    "steps": "20",  # timed optimizer steps, after the warm-up; both multiples of the logging interval, 5
    "warmup": "10",  # steps left out of the timing: LitGPT compiles its model in the first
    "litgpt_repeats": "3",  # pairs
    "litgpt_workers": "0",  # LitData's DataLoader workers (train.py's data=tokens reads in its own process)
    "litgpt_framework_compile": "false",  # true: train.py with trainer.compile=true (litgpt pretrain compiles)
    # default: bench_train's Llama of issue 19 (25.4M parameters, micro-batch 8); tiny: a smoke check of both CLIs
    "litgpt_shape": "default",
    "litgpt_out": str(REPO_ROOT / "docs" / "results" / "bench_train_litgpt_cli.json"),
}
PRECISIONS = {"32": "32-true", "bf16-mixed": "bf16-mixed"}
TINY_SHAPE, TINY_MICRO = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96, "seq_len": 32}, 2


def model_config(cfg) -> dict:
    """LitGPT's ``Config`` fields of train.py's Llama (``cfg.model``): ``model_config`` of the ``--config`` yaml."""
    llm = cfg.model.llm
    return {
        "name": f"disttrain-{cfg.model.name}",
        "block_size": int(cfg.model.seq_len),
        "vocab_size": int(llm.vocab_size),
        "padded_vocab_size": int(llm.vocab_size),
        "n_layer": int(llm.n_layers),
        "n_head": int(llm.n_heads),
        "n_query_groups": int(llm.n_kv_heads),
        "n_embd": int(llm.dim),
        "head_size": int(llm.dim) // int(llm.n_heads),
        "intermediate_size": int(llm.ffn_dim),
        "bias": False,
        "norm_class_name": "RMSNorm",
        "norm_eps": float(llm.norm_eps),
        "mlp_class_name": "LLaMAMLP",
        "rotary_percentage": 1.0,
        "parallel_residual": False,
        "rope_base": int(llm.rope_theta),
    }


def write_inputs(tmp: Path, cfg, windows: np.ndarray) -> dict[str, Path]:
    """In ``tmp``: the config file ``--config`` reads (the model's name and ``model_config``, as LitGPT's own
    pretraining configs give them: ``--model_config`` takes no file), and the windows, one a row in train.py's
    order ([windows, seq_len + 1] int32); and where the chunks go."""
    paths = {"config": tmp / "pretrain.yaml", "windows": tmp / "windows.npy", "chunks": tmp / "chunks"}
    model = model_config(cfg)
    paths["config"].write_text(yaml.safe_dump({"model_name": model["name"], "model_config": model}, sort_keys=False))
    np.save(paths["windows"], windows.reshape(-1, windows.shape[-1]).astype(np.int32))
    return paths


def pretrain_command(litgpt: Path, cfg, paths: dict[str, Path], out_dir: Path, workers: int) -> list[str]:
    """``litgpt pretrain`` on ``cfg``'s model, batch, steps, optimizer, schedule, precision, seed and logging
    interval, reading the chunks with its LitData module and logging to CSV in ``out_dir``."""
    optim, trainer = cfg.optim, cfg.trainer
    optimizer = {
        "class_path": "torch.optim.AdamW",
        "init_args": {
            "lr": optim.lr,
            "weight_decay": optim.weight_decay,
            "betas": list(optim.betas),
            "eps": optim.eps,
        },
    }
    tokens = trainer.max_steps * optim.global_batch_size * cfg.model.seq_len  # `pretrain` stops at max_tokens
    return [
        str(litgpt),
        "pretrain",
        "--config", str(paths["config"]),
        "--data", "LitData",
        "--data.data_path", str(paths["chunks"]),
        "--data.num_workers", str(workers),
        "--train.micro_batch_size", str(optim.micro_batch_size),
        "--train.global_batch_size", str(optim.global_batch_size),
        "--train.max_tokens", str(tokens),
        "--train.log_interval", str(trainer.log_every_n_steps),
        "--train.max_norm", str(optim.grad_clip),
        "--train.lr_warmup_steps", str(optim.warmup_steps),
        "--train.min_lr", f"{optim.lr * optim.min_lr_ratio:.6g}",
        "--eval.final_validation", "false",
        "--optimizer", json.dumps(optimizer),
        "--precision", PRECISIONS[str(trainer.precision)],
        "--devices", "1",
        "--seed", str(trainer.seed),
        "--logger_name", "csv",
        "--out_dir", str(out_dir),
    ]  # fmt: skip


def train_command(overrides: list[str], run_dir: Path) -> list[str]:
    """``python train.py`` with ``overrides``, its Hydra run directory (and so its metrics.jsonl) in ``run_dir``."""
    return [sys.executable, str(REPO_ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]


def litgpt_rates(metrics_csv: Path, warmup: int, accumulation: int = 1) -> dict:
    """Tokens/s from LitGPT's CSV log between the row of step ``warmup`` and the last: the ``tokens`` it had read
    and the ``time`` since its loop started, as it logged them. Rows are found by ``iter`` (micro-batches; Fabric
    writes its own step index, ``iter - 1``, over the ``step`` column). Also its own windowed figure of the last row
    (``device/items_per_sec``: tokens/s over its last 5 logs, once it has 5)."""
    with open(metrics_csv, newline="") as file:
        rows = [row for row in csv.DictReader(file) if row.get("iter")]  # validation rows have none
    start = next(row for row in rows if int(float(row["iter"])) == warmup * accumulation)
    last = rows[-1]
    own = last.get("device/items_per_sec")
    return {
        "tokens_per_s": (float(last["tokens"]) - float(start["tokens"])) / (float(last["time"]) - float(start["time"])),
        "logged_items_per_sec": float(own) if own else None,
        "steps": int(float(last["iter"])) // accumulation,
    }


def run(command: list[str], env: dict) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        print(done.stdout[-3000:], done.stderr[-6000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"error: exit status {done.returncode}: {' '.join(command[:3])} ...")


def one_run(kind: str, command: list[str], run_dir: Path, warmup: int, cfg, env: dict) -> dict:
    run(command, env)
    if kind == "litgpt":
        accumulation = cfg.optim.global_batch_size // cfg.optim.micro_batch_size
        result = litgpt_rates(next(run_dir.rglob("metrics.csv")), warmup, accumulation)
    else:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        result = framework_rates(records, warmup, cfg.model.seq_len)
        result["steps"] = records[-1]["step"]
    if result["steps"] != cfg.trainer.max_steps:
        raise SystemExit(f"error: {kind} logged {result['steps']} steps, not {cfg.trainer.max_steps}")
    return result


def compare(options: dict, steps: int, warmup: int, threads: int) -> dict:
    precision, repeats, workers = options["litgpt_precision"], int(options["litgpt_repeats"]), options["litgpt_workers"]
    python = litgpt_python()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="")  # both on the CPU
    with tempfile.TemporaryDirectory(prefix="litgpt-cli-") as scratch:
        tmp = Path(scratch)
        tiny = {"shape": TINY_SHAPE, "micro": TINY_MICRO} if options["litgpt_shape"] == "tiny" else {}
        cfg, extra, data, windows = litgpt_setup(tmp, precision, steps, warmup, **tiny)
        extra += data + (("trainer.compile=true",) if options["litgpt_framework_compile"] == "true" else ())
        paths = write_inputs(tmp, cfg, windows)
        prepare = [
            str(python),
            str(REPO_ROOT / "tools" / "litgpt_chunks.py"),
            str(paths["windows"]),
            str(paths["chunks"]),
        ]
        run(prepare, env)
        commands: dict[str, list[str]] = {"prepare_chunks": prepare}
        pairs = []
        for repeat in range(repeats):  # alternate which goes first
            pair = {"first": "train.py" if repeat % 2 == 0 else "litgpt"}
            for kind in ("train.py", "litgpt") if repeat % 2 == 0 else ("litgpt", "train.py"):
                run_dir = tmp / f"{kind}-{repeat}"
                if kind == "litgpt":
                    command = pretrain_command(LITGPT_VENV / "bin" / "litgpt", cfg, paths, run_dir, int(workers))
                else:
                    command = train_command(
                        _overrides("llama_tiny", precision, run_dir, warmup + steps) + [*extra], run_dir
                    )
                commands.setdefault(kind, command)
                result = one_run(kind, command, run_dir, warmup, cfg, env)
                pair[kind] = result
                print(f"pair {repeat + 1}/{repeats} {kind}: {result['tokens_per_s']:,.0f} tokens/s", flush=True)
            pair["ratio"] = pair["train.py"]["tokens_per_s"] / pair["litgpt"]["tokens_per_s"]
            pairs.append(pair)
    return summary(cfg, pairs, commands, windows, options, threads, python)


def summary(cfg, pairs: list[dict], commands: dict, windows: np.ndarray, options: dict, threads: int, python) -> dict:
    ratios = [pair["ratio"] for pair in pairs]
    litgpt, litgpt_torch = litgpt_version(python).split()
    return {
        "settings": {
            "shape": {k: v for k, v in model_config(cfg).items() if k != "name"},
            "micro_batch": cfg.optim.micro_batch_size,
            "global_batch": cfg.optim.global_batch_size,
            "steps": cfg.trainer.max_steps - int(options["warmup"]),
            "warmup": int(options["warmup"]),
            "log_every": cfg.trainer.log_every_n_steps,
            "precision": options["litgpt_precision"],
            "litgpt_data_workers": int(options["litgpt_workers"]),
            "train_py_compile": options["litgpt_framework_compile"] == "true",
            "threads": threads,
            "windows": int(np.prod(windows.shape[:-1])),  # of seq_len + 1 tokens: the same ids on both sides
        },
        "versions": {"torch": torch.__version__, "litgpt": litgpt, "litgpt_torch": litgpt_torch},
        "commands": {kind: shlex.join(command) for kind, command in commands.items()},  # of the first pair
        "pairs": [{k: (round(v, 4) if k == "ratio" else v) for k, v in pair.items()} for pair in pairs],
        "train_py_tokens_per_s": [round(pair["train.py"]["tokens_per_s"], 1) for pair in pairs],
        "litgpt_tokens_per_s": [round(pair["litgpt"]["tokens_per_s"], 1) for pair in pairs],
        "paired_ratios": [round(r, 4) for r in ratios],
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def main(argv: list[str]) -> int:
    options = tool_options(argv, OPTIONS)
    steps, warmup = int(options["steps"]), int(options["warmup"])
    if steps % LOG_EVERY or warmup % LOG_EVERY or warmup < LOG_EVERY:
        raise SystemExit(
            f"error: steps={steps} and warmup={warmup} must be positive multiples of {LOG_EVERY} (both log)"
        )
    if options["litgpt_shape"] not in ("default", "tiny"):
        raise SystemExit(f"error: litgpt_shape={options['litgpt_shape']!r}: use default or tiny")
    if options["litgpt_precision"] not in PRECISIONS:
        raise SystemExit(f"error: litgpt_precision={options['litgpt_precision']!r}: use 32 or bf16-mixed")
    threads = int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))
    result = compare(options, steps, warmup, threads)
    out = Path(options["litgpt_out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(
        f"train.py / litgpt pretrain: median {result['ratio_median']:.3f} over {len(result['paired_ratios'])} pairs "
        f"(spread {result['ratio_min']:.3f}-{result['ratio_max']:.3f}); wrote {out}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
