"""The FSDP2 mixed-precision phase of tools/gpu_check.py (docs/COMPOSITIONS.md "FSDP2 mixed precision").

The check's Llama (~1B on CUDA, tiny on the CPU) as the runtime builds an LLM stage (parallel/stages.py), sharded by
parallel/fsdp.py's ``apply_fsdp`` under zero3 with bf16 parameters (``MixedPrecisionPolicy``: bf16 gathers and
compute, fp32 gradient reduction into the fp32 sharded master weights; the last block, head and root kept gathered
after forward) on a one-rank process group of the device's backend (NCCL on CUDA), trained a few steps with AdamW
under bf16 autocast. Passes when the losses are finite and fall, the kept last block holds bf16 parameters between
forward and backward, and on CUDA the last step's peak allocated memory is within 0.75-1.33x of the memory model's
prediction for the same run (``planner.config_roles``: the role ``tools/memory.py`` prints), the bounds of the
recompute phase. On the CPU the peak is not measured (no device allocator): the phase checks the code path."""

from __future__ import annotations

import torch
from gpu_check_phases import Check, llama_overrides

STEPS = 4


def _predicted_peak(check: Check) -> float:
    from disttrain_core.config import compose
    from disttrain_core.planner import config_roles

    layout = ["parallel=dp", "parallel.shard=zero3", "trainer.devices=1", "trainer.precision=bf16-mixed"]
    batch = [f"optim.global_batch_size={check.micro_batch}", f"optim.micro_batch_size={check.micro_batch}"]
    where = [f"trainer.accelerator={check.device}", f"paths.output_dir={check.scratch / 'fsdp_bf16'}"]
    roles, _ = config_roles(compose([*llama_overrides(check), *layout, *batch, *where]))
    return float(roles[0].as_dict()["peak"])


class _Segments:
    """Allocated bytes at the start of the last step, and after and at the peak of each of its parts (CUDA)."""

    def __init__(self, on: bool):
        self.on, self.seen = on, {}
        if on:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.seen["start"] = {"allocated": torch.cuda.memory_allocated(), "peak": torch.cuda.memory_allocated()}

    def __call__(self, name: str) -> None:
        if self.on:
            torch.cuda.synchronize()
            self.seen[name] = {"allocated": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated()}
            torch.cuda.reset_peak_memory_stats()


def _state(stage, optimizer) -> dict:
    """Bytes behind the stage's parameters (local shards), gradients and AdamW moments, each storage once."""
    from disttrain_core.train.memory_report import count_storages

    local = [getattr(p, "_local_tensor", p) for p in stage.parameters()]
    grads = [getattr(p.grad, "_local_tensor", p.grad) for p in stage.parameters() if p.grad is not None]
    moments = [getattr(v, "_local_tensor", v) for st in optimizer.state.values() for v in st.values() if v.numel() > 1]
    return count_storages({"params": local, "grads": grads, "moments": moments})


def _stage(check: Check, mesh):
    from disttrain_core.config import compose
    from disttrain_core.data.tokenizer import tokenizer_for
    from disttrain_core.models import materialize
    from disttrain_core.parallel.fsdp import apply_fsdp
    from disttrain_core.parallel.stages import build_unit_stage

    cfg = compose([*llama_overrides(check), f"paths.output_dir={check.scratch / 'fsdp_bf16'}"])
    stage = build_unit_stage(cfg.model, tokenizer_for(cfg), "llm", ("llm",), 0, 1)
    apply_fsdp(stage, mesh, "zero3", torch.bfloat16)
    materialize(stage, check.device, seed=0, std=0.02)
    return stage, int(cfg.model.llm.vocab_size)


def phase_fsdp_bf16(check: Check) -> dict:
    """FSDP2 with bf16 parameters on one rank: losses, the kept block's dtype, the peak against the model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from disttrain_core.data.batch import text_rows

    backend = "nccl" if check.cuda else "gloo"
    dist.init_process_group(
        backend, store=dist.FileStore(str(check.scratch / "fsdp_bf16_store"), 1), rank=0, world_size=1
    )
    try:
        stage, vocab = _stage(check, init_device_mesh(check.device, (1,)))
        optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3, fused=True)  # the runtime's (parallel/zero.py)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (check.micro_batch, check.seq_len), generator=generator).to(check.device)
        batch = text_rows(tokens, tokens)
        last_block = list(stage.model.llm.layers.values())[-1]
        losses, kept_dtype, segments = [], None, {}
        for step in range(STEPS):
            mark = _Segments(check.cuda and step == STEPS - 1)
            with torch.autocast(check.device, dtype=torch.bfloat16):
                out = stage(None, batch)
            loss = sum(out.loss_sums.values()) / tokens.numel()
            kept_dtype = next(last_block.parameters()).dtype  # gathered, between its forward and backward
            mark("forward")
            loss.backward()
            mark("backward")
            optimizer.step()
            mark("optimizer_step")
            state = _state(stage, optimizer)
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach().float()))
            segments = mark.seen or segments
        peak = max((s["peak"] for s in segments.values()), default=None)
    finally:
        dist.destroy_process_group()
    predicted = _predicted_peak(check)
    ratio = predicted / peak if peak else None
    falling = all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    ok = falling and kept_dtype == torch.bfloat16 and (ratio is None or 0.75 <= ratio <= 1.33)
    return {
        "ok": ok,
        "backend": backend,
        "losses": losses,
        "kept_block_dtype": str(kept_dtype),
        "measured_peak_bytes": peak,
        "predicted_peak_bytes": predicted,
        "predicted_over_measured": ratio,
        "last_step_segments": segments,
        "state_after_step": state,
    }
