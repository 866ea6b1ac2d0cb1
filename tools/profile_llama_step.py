"""Where a training step of the LitGPT-comparison Llama shape spends its time, for this repository's model or
LitGPT's (issue 19): ``torch.profiler`` over ``steps`` steps after a warm-up, operators by self CPU time.

Runs in either venv and imports only its own side: ``impl=disttrain`` (the project's .venv) builds
disttrain_core's Llama, ``impl=litgpt`` (.venv-litgpt, tools/bench_train.py litgpt=true creates it) LitGPT's GPT,
both with the shape of tools/bench_train.py (LITGPT_SHAPE), AdamW and gradient clipping at 1.0, on the same
random token rows. Prints JSON: milliseconds per step in total and per operator (top ``top``).

``impl=train_py`` (.venv) and ``impl=litgpt_loop`` (.venv-litgpt) profile instead a whole run of ``steps`` steps,
start-up included, as tools/bench_train.py's LitGPT comparison times them: ``train.py``'s launcher on a token
file, or LitGPT's training loop (tools/litgpt_step_timer.py). ``operators_ms_per_step`` is every operator's self
time over the run divided by its steps: what the two spend in kernels, whatever runs around them.

    .venv/bin/python tools/profile_llama_step.py impl=disttrain
    .venv-litgpt/bin/python tools/profile_llama_step.py impl=litgpt
    .venv/bin/python tools/profile_llama_step.py impl=train_py precision=bf16-mixed steps=10
    .venv-litgpt/bin/python tools/profile_llama_step.py impl=litgpt_loop precision=bf16-mixed steps=10
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# tools/bench_train.py's LITGPT_SHAPE in LlamaConfig's field names, with the sequence and micro-batch
SHAPE = {
    "vocab_size": 384,
    "dim": 512,
    "n_layers": 8,
    "n_heads": 8,
    "n_kv_heads": 4,
    "ffn_dim": 1536,
    "norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
SEQ, MICRO = 512, 8


def build(impl: str):
    if impl == "litgpt":
        from litgpt.model import GPT
        from litgpt.utils import chunked_cross_entropy
        from litgpt_step_timer import litgpt_config  # tools/, beside this file

        net = GPT(litgpt_config(SHAPE, SEQ))
        return net, lambda x, y: chunked_cross_entropy(net(x), y)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from disttrain_core.config.model import LlamaConfig
    from disttrain_core.models.llama import Llama

    net = Llama(LlamaConfig(**SHAPE), SEQ)
    return net, lambda x, y: F.cross_entropy(net(x).float().flatten(0, 1), y.flatten(), reduction="sum") / y.numel()


def whole_run(impl: str, precision: str, steps: int):
    """The profiler around a whole run of ``steps`` steps, start-up included: ``train.py``'s (``impl=train_py``:
    its launcher in this process, data=tokens, bench_train's overrides) or LitGPT's loop (``impl=litgpt_loop``:
    tools/litgpt_step_timer.py on random windows)."""
    import tempfile

    import numpy as np

    tmp = Path(tempfile.mkdtemp())
    if impl == "litgpt_loop":
        from litgpt_step_timer import main as litgpt_main  # tools/, beside this file

        windows = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (steps, 1, MICRO, SEQ + 1))
        np.save(tmp / "windows.npy", windows)
        spec = {"windows": str(tmp / "windows.npy"), "warmup": 1, "log_every": 5, "threads": torch.get_num_threads()}
        spec.update(seed=0, precision={"32": "32-true"}.get(precision, precision), lr=3e-4, weight_decay=0.1)
        spec.update(betas=[0.9, 0.95], shape=SHAPE)
        return lambda: litgpt_main(spec)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench_train import LITGPT_SHAPE, _overrides  # tools/, beside this file

    from disttrain_core.config import compose
    from disttrain_core.launch.entry import launch

    np.save(tmp / "tokens.npy", np.random.default_rng(0).integers(0, SHAPE["vocab_size"], 1 << 20).astype(np.uint16))
    extra = [f"model.llm.{k}={v}" for k, v in LITGPT_SHAPE.items() if k != "seq_len"]
    extra += [f"model.seq_len={SEQ}", f"optim.micro_batch_size={MICRO}", f"optim.global_batch_size={MICRO}"]
    extra += ["data=tokens", f"data.path={tmp / 'tokens.npy'}"]
    cfg = compose(_overrides("llama_tiny", precision, tmp / "run", steps) + extra)
    return lambda: launch(cfg)


def main(argv: list[str]) -> int:
    options = {"impl": "disttrain", "precision": "32", "warmup": "3", "steps": "3", "top": "15"}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in options:
            raise SystemExit(f"error: unknown option {key!r}; options: {', '.join(options)}")
        options[key] = value
    torch.manual_seed(0)
    if options["impl"] in ("train_py", "litgpt_loop"):
        steps = int(options["steps"])
        run = whole_run(options["impl"], options["precision"], steps)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            run()
            wall = time.perf_counter() - started
        return report(options, prof, steps, wall)
    net, loss_of = build(options["impl"])
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.1)
    x = torch.randint(0, SHAPE["vocab_size"], (MICRO, SEQ))
    y = torch.randint(0, SHAPE["vocab_size"], (MICRO, SEQ))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=options["precision"] == "bf16-mixed")

    def step():
        with autocast:
            loss = loss_of(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(int(options["warmup"])):
        step()
    steps = int(options["steps"])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - started
    return report(options, prof, steps, wall)


def report(options: dict, prof, steps: int, wall: float) -> int:
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    top = [
        {"op": e.key, "ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 2), "calls": e.count // steps}
        for e in ops[: int(options["top"])]
    ]
    print(
        json.dumps(
            {
                "impl": options["impl"],
                "precision": options["precision"],
                "ms_per_step": round(wall / steps * 1e3, 1),
                "operators_ms_per_step": round(sum(e.self_cpu_time_total for e in ops) / 1e3 / steps, 1),
                "top": top,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
