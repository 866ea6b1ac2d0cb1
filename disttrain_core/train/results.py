"""What a training step leaves on the device, and reading a window of steps back at a logging step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base.clock import DeviceClock, Stamp


@dataclass
class StepResult:
    """One step, as the device left it: nothing here has been read on the host yet."""

    sums: dict[str, torch.Tensor]  # global loss sums (lm_loss_sum, gen_loss_sum)
    counts: torch.Tensor  # global [loss tokens, generation samples, sequences, images]
    grad_norm: torch.Tensor
    lr: float
    data_wait_s: float  # host seconds waiting for the batch
    started: Stamp  # device clock at the start of the step (before its batch was fetched)
    ended: Stamp
    moe: torch.Tensor | None = None  # MoE models: [assignments dropped, worst max/mean expert load]


@dataclass
class StepValues:
    """A StepResult read on the host (at a logging step)."""

    loss: float
    lm_loss: float
    gen_loss: float
    grad_norm: float
    lr: float
    sequences: int
    images: int
    clips: int  # audio clips
    groups: int  # video frame groups
    loss_tokens: int
    data_wait_s: float
    step_time_s: float


def read_results(results: list[StepResult], weight: float) -> list[StepValues]:
    """One device-to-host copy for a window of steps."""
    if not results:
        return []
    zero = results[0].counts.new_zeros(())
    rows = torch.stack(
        [
            torch.stack(
                [
                    r.sums.get("lm_loss_sum", zero).double(),
                    r.sums.get("gen_loss_sum", zero).double(),
                    r.grad_norm.double() if torch.is_tensor(r.grad_norm) else zero + r.grad_norm,
                    *r.counts.double(),
                ]
            )
            for r in results
        ]
    ).tolist()
    values = []
    for r, (lm_sum, gen_sum, grad_norm, tokens, gen, sequences, images, clips, groups) in zip(
        results, rows, strict=True
    ):
        lm_loss, gen_loss = lm_sum / max(tokens, 1.0), gen_sum / max(gen, 1.0)
        values.append(
            StepValues(
                loss=lm_loss + weight * gen_loss,
                lm_loss=lm_loss,
                gen_loss=gen_loss,
                grad_norm=grad_norm,
                lr=r.lr,
                sequences=int(sequences),
                images=int(images),
                clips=int(clips),
                groups=int(groups),
                loss_tokens=int(tokens),
                data_wait_s=r.data_wait_s,
                step_time_s=DeviceClock.elapsed(r.started, r.ended),
            )
        )
    return values
