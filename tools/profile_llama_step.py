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

import torch
import torch.nn.functional as F

SHAPE = {"vocab": 384, "dim": 512, "layers": 8, "heads": 8, "kv_heads": 4, "ffn": 1536, "seq": 512, "micro": 8}


def build(impl: str):
    s = SHAPE
    if impl == "litgpt":
        from litgpt.config import Config
        from litgpt.model import GPT
        from litgpt.utils import chunked_cross_entropy

        net = GPT(
            Config(
                name="bench",
                block_size=s["seq"],
                vocab_size=s["vocab"],
                padded_vocab_size=s["vocab"],
                n_layer=s["layers"],
                n_head=s["heads"],
                n_query_groups=s["kv_heads"],
                n_embd=s["dim"],
                intermediate_size=s["ffn"],
                bias=False,
                norm_class_name="RMSNorm",
                mlp_class_name="LLaMAMLP",
                rotary_percentage=1.0,
                parallel_residual=False,
                rope_base=10000,
            )
        )
        return net, lambda x, y: chunked_cross_entropy(net(x), y)
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from disttrain_core.config.model import LlamaConfig
    from disttrain_core.models.llama import Llama

    net = Llama(
        LlamaConfig(
            vocab_size=s["vocab"],
            dim=s["dim"],
            n_layers=s["layers"],
            n_heads=s["heads"],
            n_kv_heads=s["kv_heads"],
            ffn_dim=s["ffn"],
            rope_theta=10000.0,
        ),
        s["seq"],
    )
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
    x = torch.randint(0, SHAPE["vocab"], (SHAPE["micro"], SHAPE["seq"]))
    y = torch.randint(0, SHAPE["vocab"], (SHAPE["micro"], SHAPE["seq"]))
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
