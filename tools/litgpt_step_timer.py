"""Times LitGPT's training step; runs inside .venv-litgpt (tools/bench_train.py litgpt=true starts it).

It imports LitGPT and torch only (not this repository), builds ``litgpt.model.GPT`` with the shape given as
JSON, and runs the loop of LitGPT's own ``litgpt/pretrain.py`` ``fit``: Fabric setup, a learning rate set per
step, forward, ``chunked_cross_entropy``, ``fabric.backward`` of the loss over the accumulation steps, gradient
clipping at 1.0, AdamW step, ``zero_grad``, and LitGPT's per-step loss bookkeeping (``RunningMean``, read on
the host at each log, every 5 steps here as in the framework's run). The input is the framework's own windows
(``windows.npy``: [steps, accumulation, micro_batch, seq_len + 1] token ids), loaded into memory before the
clock starts. Prints one JSON line: tokens per second between the end of the warm-up and the last step.

    .venv-litgpt/bin/python tools/litgpt_step_timer.py '{"windows": "w.npy", "warmup": 5, ...}'
"""

import json
import math
import sys
import time

import numpy as np
import torch


def litgpt_config(shape: dict, block_size: int):
    """LitGPT's Config of a Llama with ``shape`` (this repository's LlamaConfig field names)."""
    from litgpt.config import Config

    return Config(
        name="bench",
        block_size=block_size,
        vocab_size=shape["vocab_size"],
        padded_vocab_size=shape["vocab_size"],
        n_layer=shape["n_layers"],
        n_head=shape["n_heads"],
        n_query_groups=shape["n_kv_heads"],
        n_embd=shape["dim"],
        intermediate_size=shape["ffn_dim"],
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=shape["norm_eps"],
        mlp_class_name="LLaMAMLP",
        rotary_percentage=1.0,
        parallel_residual=False,
        rope_base=int(shape["rope_theta"]),
    )


def main(spec: dict) -> dict:
    import lightning as L
    from litgpt.model import GPT
    from litgpt.utils import chunked_cross_entropy
    from torchmetrics.aggregation import RunningMean

    torch.set_num_threads(int(spec["threads"]))
    windows = torch.from_numpy(np.load(spec["windows"]).astype(np.int64))  # in memory before the clock
    steps, accumulation, micro, width = windows.shape
    config = litgpt_config(spec["shape"], width - 1)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision=spec["precision"])
    fabric.seed_everything(spec["seed"])
    with fabric.init_module(empty_init=False):
        model = GPT(config)
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"], betas=tuple(spec["betas"])
    )
    optimizer = fabric.setup_optimizers(optimizer)
    running_loss = RunningMean(window=accumulation, sync_on_compute=False).to(fabric.device)
    warmup, log_every = spec["warmup"], spec["log_every"]
    started = None
    for step in range(steps):
        if step == warmup:
            started = time.perf_counter()
        lr = spec["lr"] * 0.5 * (1 + math.cos(math.pi * step / steps))  # LitGPT sets it every step
        for group in optimizer.param_groups:
            group["lr"] = lr
        for index in range(accumulation):
            batch = windows[step, index]
            input_ids, targets = batch[:, :-1], batch[:, 1:]
            with fabric.no_backward_sync(model, enabled=index < accumulation - 1):
                logits = model(input_ids)
                loss = chunked_cross_entropy(logits, targets)
                fabric.backward(loss / accumulation)
            running_loss.update(loss.detach())
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % log_every == 0:
            running_loss.compute().item()
    seconds = time.perf_counter() - started
    return {"tokens_per_s": (steps - warmup) * accumulation * micro * (width - 1) / seconds}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
