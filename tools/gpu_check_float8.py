"""The FP8 phase of tools/gpu_check.py (model.float8, parallel/float8.py).

On a GPU with FP8 tensor cores (compute capability 8.9+): the check's Llama on its token file for 50 steps,
compiled, in bf16 and with model.float8=tensorwise and rowwise; passes when each FP8 run's last logged loss is
within 1% of bf16's, and reports tokens/s of each against bf16 (same machine, same run of the check). On the
CPU or an older GPU: the setting is refused before launch, in one line naming the reason."""

from __future__ import annotations

import torch
from gpu_check_phases import Check, tokens_runs, train

STEPS = 50


def _refusal(check: Check) -> str | None:
    from disttrain_core.config import compose, typed_config
    from disttrain_core.validation import ConfigError, validate_config

    overrides = [*tokens_runs(check), f"trainer.accelerator={check.device}", "model.float8=tensorwise"]
    try:
        validate_config(typed_config(compose(overrides)))
    except ConfigError as error:
        return str(error)
    return None


def phase_float8(check: Check) -> dict:
    """FP8 against bf16 where the GPU has FP8; the one-line refusal where it has not."""
    fp8 = check.cuda and torch.cuda.get_device_capability() >= (8, 9)
    if not fp8:
        message = _refusal(check)
        expected = "has no FP8 tensor cores" if check.cuda else "runs FP8 matmuls on NVIDIA GPUs"
        return {"ok": message is not None and expected in message, "refused": message}
    base = [
        *tokens_runs(check),
        f"trainer.max_steps={STEPS}",
        "trainer.log_every_n_steps=10",
        "trainer.precision=bf16-mixed",
        "trainer.compile=true",
    ]
    runs = {"bf16": train(check, "fp8_bf16", base)}
    for recipe in ("tensorwise", "rowwise"):
        runs[recipe] = train(check, f"fp8_{recipe}", [*base, f"model.float8={recipe}"])
    last = {name: metrics[-1] for name, metrics in runs.items()}
    result = {"steps": STEPS, "bf16_loss": last["bf16"]["loss"], "bf16_tokens_per_s": last["bf16"]["perf/tokens_per_s"]}
    ok = True
    for recipe in ("tensorwise", "rowwise"):
        gap = abs(last[recipe]["loss"] - last["bf16"]["loss"]) / last["bf16"]["loss"]
        speed = last[recipe]["perf/tokens_per_s"] / last["bf16"]["perf/tokens_per_s"]
        result[recipe] = {"loss": last[recipe]["loss"], "loss_gap": gap, "tokens_per_s_over_bf16": speed}
        ok = ok and gap <= 0.01
    return {"ok": ok, **result}
