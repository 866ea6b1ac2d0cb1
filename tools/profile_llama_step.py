"""Where a training step of the LitGPT-comparison Llama shape spends its time, for this repository's model or
LitGPT's (issue 19): ``torch.profiler`` over ``steps`` steps after a warm-up, operators by self CPU time.

Runs in either venv and imports only its own side: ``impl=disttrain`` (the project's .venv) builds
disttrain_core's Llama, ``impl=litgpt`` (.venv-litgpt, tools/bench_train.py litgpt=true creates it) LitGPT's GPT,
both with the shape of tools/bench_train.py (LITGPT_SHAPE), AdamW and gradient clipping at 1.0, on the same
random token rows. Prints JSON: milliseconds per step in total and per operator (top ``top``).

    .venv/bin/python tools/profile_llama_step.py impl=disttrain
    .venv-litgpt/bin/python tools/profile_llama_step.py impl=litgpt
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


def main(argv: list[str]) -> int:
    options = {"impl": "disttrain", "precision": "32", "warmup": "3", "steps": "3", "top": "15"}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in options:
            raise SystemExit(f"error: unknown option {key!r}; options: {', '.join(options)}")
        options[key] = value
    torch.manual_seed(0)
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
                "top": top,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
